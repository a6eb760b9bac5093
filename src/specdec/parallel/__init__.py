"""Running one model over several processes (torch.distributed).

    tensor.py   tensor parallelism with the bits of one process: shard_model, OutputShard, gather_last
"""
