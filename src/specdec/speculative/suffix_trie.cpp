// Bounded-depth suffix tries with occurrence counts: the data structure of suffix decoding
// (Oliaro et al., arXiv 2411.04975). Loaded with ctypes by specdec/speculative/suffix.py, which holds the
// same algorithm in Python (`PySuffixTrie`, the reference the tests check this one against).
//
// A trie holds every substring of length <= depth of its sequences; node x counts the occurrences of the
// string x. Appending token t to a sequence inserts the suffixes that end at t: the sequence keeps the nodes
// of its suffixes of length 0..depth-1 ("active"), and each gets (or creates) its child t, count + 1: O(depth)
// per token. Removing a sequence walks each of its suffixes and subtracts its counts; nodes at 0 are freed.
// Children are found through one hash table keyed by (parent, token) and listed through sibling links; each
// node keeps its most frequent child and its children's total count, so that a chain draft is O(1) a token.
//
// Speculation from a context: for each match length m = 1, 2, ... while the context's last m tokens are a
// path of the trie, continue from that node by the most frequent child (ties: the most recently seen), the
// probability of each step being count(child) / sum of the children's counts, while the path probability
// stays >= min_prob, for at most min(max_tokens, m * factor, depth - m) tokens (a tree: best-first by path
// probability). The match length whose draft has the highest score (sum of its path probabilities) wins;
// on a tie, the longer match.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <queue>
#include <unordered_map>
#include <vector>

namespace {

constexpr int32_t NIL = -1;
constexpr uint64_t EMPTY = ~0ull;

// (parent, token) -> child: open addressing with linear probing and backward-shift deletion.
class ChildTable {
 public:
  ChildTable() { resize(64); }

  static uint64_t key(int32_t parent, int32_t token) {
    return (uint64_t(uint32_t(parent)) << 32) | uint32_t(token);
  }

  int32_t find(uint64_t k) const {
    for (size_t i = slot(k);; i = (i + 1) & mask_) {
      if (keys_[i] == k) return vals_[i];
      if (keys_[i] == EMPTY) return NIL;
    }
  }

  void insert(uint64_t k, int32_t v) {
    if ((used_ + 1) * 10 > keys_.size() * 7) resize(keys_.size() * 2);
    size_t i = slot(k);
    while (keys_[i] != EMPTY) i = (i + 1) & mask_;
    keys_[i] = k;
    vals_[i] = v;
    ++used_;
  }

  void erase(uint64_t k) {
    size_t i = slot(k);
    while (keys_[i] != k) i = (i + 1) & mask_;
    for (size_t j = (i + 1) & mask_; keys_[j] != EMPTY; j = (j + 1) & mask_) {
      size_t home = slot(keys_[j]);
      // move entry j back into the hole at i unless its home lies cyclically in (i, j]
      if (((j - home) & mask_) >= ((j - i) & mask_)) {
        keys_[i] = keys_[j];
        vals_[i] = vals_[j];
        i = j;
      }
    }
    keys_[i] = EMPTY;
    --used_;
  }

  size_t bytes() const { return keys_.capacity() * sizeof(uint64_t) + vals_.capacity() * sizeof(int32_t); }

 private:
  size_t slot(uint64_t k) const { return size_t((k * 0x9E3779B97F4A7C15ull) >> shift_); }

  void resize(size_t capacity) {
    std::vector<uint64_t> keys(std::move(keys_));
    std::vector<int32_t> vals(std::move(vals_));
    keys_.assign(capacity, EMPTY);
    vals_.assign(capacity, NIL);
    mask_ = capacity - 1;
    shift_ = 64 - __builtin_ctzll(capacity);
    used_ = 0;
    for (size_t i = 0; i < keys.size(); ++i)
      if (keys[i] != EMPTY) insert(keys[i], vals[i]);
  }

  std::vector<uint64_t> keys_;
  std::vector<int32_t> vals_;
  size_t mask_ = 0, used_ = 0;
  int shift_ = 0;
};

struct Sequence {
  std::vector<int32_t> tokens;
  std::vector<int32_t> active;  // nodes of the suffixes of length 1..depth-1 ending at the last token
};

struct Item {  // a frontier node of a tree speculation
  double prob;
  int64_t order;  // ties: the node pushed first
  int32_t node, parent, depth;
  bool operator<(const Item& o) const { return prob != o.prob ? prob < o.prob : order > o.order; }
};

class Trie {
 public:
  explicit Trie(int depth) : depth_(depth) { new_node(NIL); }  // node 0: the root (the empty string)

  void extend(int seq_id, const int32_t* tokens, int n) {
    Sequence& s = seqs_[seq_id];
    std::vector<int32_t> next;
    for (int i = 0; i < n; ++i) {
      int32_t t = tokens[i];
      s.tokens.push_back(t);
      ++clock_;
      count_[0] += 1;
      next.clear();
      int32_t c = child_or_new(0, t);  // the suffix of length 1
      if (depth_ > 1) next.push_back(c);
      for (size_t j = 0; j < s.active.size(); ++j) {  // suffix of length j + 1 -> length j + 2
        c = child_or_new(s.active[j], t);
        if (int(j) + 2 < depth_) next.push_back(c);
      }
      s.active.swap(next);
    }
  }

  void remove(int seq_id) {
    auto it = seqs_.find(seq_id);
    if (it == seqs_.end()) return;
    const std::vector<int32_t>& seq = it->second.tokens;
    std::vector<int32_t> path;
    int n = int(seq.size());
    count_[0] -= n;
    for (int start = 0; start < n; ++start) {
      path.clear();
      path.push_back(0);
      int32_t node = 0;
      for (int i = start; i < n && i - start < depth_; ++i) {
        int32_t parent = node;
        node = children_.find(ChildTable::key(node, seq[i]));
        count_[node] -= 1;
        total_[parent] -= 1;
        path.push_back(node);
      }
      // the nodes at 0 are a tail of the path (a child never counts more than its parent): free them leaf first
      size_t alive = path.size();
      while (alive > 1 && count_[path[alive - 1]] == 0) {
        unlink(path[alive - 2], path[alive - 1]);
        --alive;
      }
      for (size_t j = 0; j < alive; ++j)  // a decremented (or freed) best child may no longer be the best
        if (j + 1 < path.size() && best_[path[j]] == path[j + 1]) best_[path[j]] = rank_children(path[j]);
    }
    seqs_.erase(it);
  }

  // Returns the number of tokens drafted; the out arrays hold max_tokens entries at least.
  int speculate(const int32_t* ctx, int n, int max_tokens, double factor, double min_prob, bool tree,
                int32_t* out_tokens, int32_t* out_parents, double* out_probs, double* out_score, int32_t* out_match) {
    std::vector<int32_t> tokens, parents, best_tokens, best_parents;
    std::vector<double> probs, best_probs;
    double best_score = 0.0;
    int best_match = 0;
    for (int m = 1; m <= n && m < depth_; ++m) {
      int32_t node = 0;
      for (int i = n - m; i < n && node != NIL; ++i) node = children_.find(ChildTable::key(node, ctx[i]));
      if (node == NIL) break;  // a longer context is no substring either
      int limit = std::min(max_tokens, int(m * factor + 1e-6));
      tokens.clear();
      parents.clear();
      probs.clear();
      if (tree) draft_tree(node, m, limit, min_prob, tokens, parents, probs);
      else draft_path(node, std::min(limit, depth_ - m), min_prob, tokens, parents, probs);
      double score = 0.0;
      for (double p : probs) score += p;
      if (!tokens.empty() && score >= best_score) {
        best_score = score;
        best_match = m;
        best_tokens.swap(tokens);
        best_parents.swap(parents);
        best_probs.swap(probs);
      }
    }
    std::copy(best_tokens.begin(), best_tokens.end(), out_tokens);
    std::copy(best_parents.begin(), best_parents.end(), out_parents);
    std::copy(best_probs.begin(), best_probs.end(), out_probs);
    *out_score = best_score;
    *out_match = best_match;
    return int(best_tokens.size());
  }

  int64_t count(const int32_t* s, int n) const {
    int32_t node = 0;
    for (int i = 0; i < n && node != NIL; ++i) node = children_.find(ChildTable::key(node, s[i]));
    return node == NIL ? 0 : count_[node];
  }

  int64_t num_nodes() const { return int64_t(token_.size() - free_.size()); }

  int64_t bytes() const {
    int64_t total = sizeof(*this) + children_.bytes();
    total += (token_.capacity() + count_.capacity() + stamp_.capacity() + total_.capacity() + first_.capacity() +
              next_.capacity() + best_.capacity() + free_.capacity()) * sizeof(int32_t);
    for (const auto& kv : seqs_)
      total += 64 + (kv.second.tokens.capacity() + kv.second.active.capacity()) * sizeof(int32_t);
    return total;
  }

 private:
  int32_t new_node(int32_t token) {
    int32_t id;
    if (!free_.empty()) {
      id = free_.back();
      free_.pop_back();
      token_[id] = token;
      count_[id] = stamp_[id] = total_[id] = 0;
      first_[id] = next_[id] = best_[id] = NIL;
    } else {
      id = int32_t(token_.size());
      token_.push_back(token);
      count_.push_back(0);
      stamp_.push_back(0);
      total_.push_back(0);
      first_.push_back(NIL);
      next_.push_back(NIL);
      best_.push_back(NIL);
    }
    return id;
  }

  int32_t child_or_new(int32_t parent, int32_t t) {
    uint64_t k = ChildTable::key(parent, t);
    int32_t c = children_.find(k);
    if (c == NIL) {
      c = new_node(t);
      children_.insert(k, c);
      next_[c] = first_[parent];
      first_[parent] = c;
    }
    count_[c] += 1;
    stamp_[c] = int32_t(clock_);
    total_[parent] += 1;
    int32_t b = best_[parent];  // c gained: the best child is c or stays (c is now the most recent)
    if (b == NIL || count_[c] >= count_[b]) best_[parent] = c;
    return c;
  }

  void unlink(int32_t parent, int32_t c) {
    children_.erase(ChildTable::key(parent, token_[c]));
    if (first_[parent] == c) {
      first_[parent] = next_[c];
    } else {
      int32_t p = first_[parent];
      while (next_[p] != c) p = next_[p];
      next_[p] = next_[c];
    }
    free_.push_back(c);
  }

  // The most frequent child of `node` (ties: the most recently seen), by a scan; `best_` keeps it.
  int32_t rank_children(int32_t node) const {
    int32_t best = NIL;
    for (int32_t c = first_[node]; c != NIL; c = next_[c])
      if (best == NIL || count_[c] > count_[best] || (count_[c] == count_[best] && stamp_[c] > stamp_[best])) best = c;
    return best;
  }

  void draft_path(int32_t node, int limit, double min_prob, std::vector<int32_t>& tokens,
                  std::vector<int32_t>& parents, std::vector<double>& probs) const {
    double prob = 1.0;
    while (int(tokens.size()) < limit) {
      int32_t c = best_[node];
      if (c == NIL) break;
      prob *= double(count_[c]) / double(total_[node]);
      if (prob < min_prob) break;
      parents.push_back(int32_t(tokens.size()) - 1);
      tokens.push_back(token_[c]);
      probs.push_back(prob);
      node = c;
    }
  }

  void draft_tree(int32_t node, int m, int limit, double min_prob, std::vector<int32_t>& tokens,
                  std::vector<int32_t>& parents, std::vector<double>& probs) const {
    std::priority_queue<Item> frontier;
    int64_t order = 0;
    auto push_children = [&](int32_t from, double prob, int32_t parent, int32_t depth) {
      if (m + depth >= depth_) return;  // no deeper nodes
      double total = total_[from];
      std::vector<int32_t> kids;  // most frequent first (ties: most recent), so that `order` ranks them
      for (int32_t c = first_[from]; c != NIL; c = next_[c]) kids.push_back(c);
      std::sort(kids.begin(), kids.end(), [&](int32_t a, int32_t b) {
        return count_[a] != count_[b] ? count_[a] > count_[b] : stamp_[a] > stamp_[b];
      });
      for (int32_t c : kids) {
        double p = prob * double(count_[c]) / total;
        if (p >= min_prob) frontier.push(Item{p, order++, c, parent, depth + 1});
      }
    };
    push_children(node, 1.0, -1, 0);
    while (int(tokens.size()) < limit && !frontier.empty()) {
      Item it = frontier.top();
      frontier.pop();
      parents.push_back(it.parent);
      tokens.push_back(token_[it.node]);
      probs.push_back(it.prob);
      push_children(it.node, it.prob, int32_t(tokens.size()) - 1, it.depth);
    }
  }

  int depth_;
  int64_t clock_ = 0;
  // per node: its token, occurrences, when last seen, its children's total count, first child and next sibling,
  // most frequent child (ties: the most recent)
  std::vector<int32_t> token_, count_, stamp_, total_, first_, next_, best_, free_;
  ChildTable children_;
  std::unordered_map<int, Sequence> seqs_;
};

}  // namespace

extern "C" {

void* st_new(int depth) { return new Trie(depth); }
void st_free(void* t) { delete static_cast<Trie*>(t); }
void st_extend(void* t, int seq_id, const int32_t* tokens, int n) { static_cast<Trie*>(t)->extend(seq_id, tokens, n); }
void st_remove(void* t, int seq_id) { static_cast<Trie*>(t)->remove(seq_id); }
int st_speculate(void* t, const int32_t* ctx, int n, int max_tokens, double factor, double min_prob, int tree,
                 int32_t* out_tokens, int32_t* out_parents, double* out_probs, double* out_score, int32_t* out_match) {
  return static_cast<Trie*>(t)->speculate(ctx, n, max_tokens, factor, min_prob, tree != 0, out_tokens, out_parents,
                                          out_probs, out_score, out_match);
}
int64_t st_count(void* t, const int32_t* s, int n) { return static_cast<Trie*>(t)->count(s, n); }
int64_t st_num_nodes(void* t) { return static_cast<Trie*>(t)->num_nodes(); }
int64_t st_bytes(void* t) { return static_cast<Trie*>(t)->bytes(); }

}  // extern "C"
