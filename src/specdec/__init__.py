"""specdec: a speculative-decoding inference engine for large language models."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # lazy, so that `import specdec` stays cheap for the CLI and the server's workers
    if name == "LLM":
        from specdec.api import LLM

        return LLM
    if name in ("SamplingParams", "SpeculativeConfig", "ModelConfig"):
        import specdec.config as config

        return getattr(config, name)
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "ModelConfig", "__version__"]
