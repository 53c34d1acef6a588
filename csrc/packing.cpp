// Balanced k-way partition of sequence lengths: the hot loop of micro-batch packing.
//
// Twin of realscale/data/packing.py::_balanced_partition_py (same algorithm, same
// tie-breaks, so both return the same assignment; tests compare them).
//
// 1. Start: under a budget, best fit decreasing (see best_fit); without one, LPT: items
//    by decreasing length (ties: lower index first) each go to the least loaded bin
//    (ties: lower bin id).  O(n log k).
// 2. Refinement: repeatedly take the most loaded bin `hi` and, scanning partner bins
//    from the least loaded up, apply the first move (one item hi -> lo) or swap (a in hi,
//    b in lo) that shifts d tokens with 0 < d < gap, choosing d closest to gap/2 (while hi
//    is over `capacity`, also lo + d <= capacity).  Such an exchange strictly lowers the
//    sum of squared loads.  An over-budget top bin that no such exchange helps gets a
//    "kick" (see kick()).  A top bin that no exchange can
//    lower (e.g. one huge sequence) is frozen and the rest keep balancing, which raises
//    the minimum.  Stops when the unfrozen bins are within 1 token (or within `spread`
//    tokens and all within capacity), or after max_iters passes.  Each pass tries at most
//    max_scan partners: this bounds the time of a nearly infeasible attempt.
//
// Karmarkar-Karp keeps k-tuples of partial sums per item (O(n k) memory: what makes the
// published allocators run out of memory at n = 65,536); this uses O(n + k).
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <queue>
#include <set>
#include <utility>
#include <vector>

namespace {

using Item = std::pair<int64_t, int64_t>;  // (length, sequence index)
using Key = std::pair<int64_t, int64_t>;   // (load, bin id)
constexpr int64_t kNoCapacity = int64_t(1) << 62;  // "no budget" (matches packing.py)

struct Exchange {
  int64_t pos_a = -1;  // position in the hi bin
  int64_t pos_b = -1;  // position in the lo bin; -1 means "move", not "swap"
};

// Best exchange between bins A (hi) and B (lo) shifting d tokens with 0 < d <= limit
// (limit < gap), d closest to min(gap / 2, limit).  Both bins are sorted ascending by
// (length, index).
bool best_exchange(const std::vector<Item>& A, const std::vector<Item>& B, int64_t gap, int64_t limit,
                   Exchange& out) {
  int64_t best = std::numeric_limits<int64_t>::max();
  const int64_t target2 = std::min(gap, 2 * limit);  // twice the ideal d
  const int64_t floor_score = target2 & 1;  // |2d - target2| can never go below its parity
  for (int64_t i = 0; i < static_cast<int64_t>(A.size()); ++i) {
    const int64_t a = A[i].first;
    if (a <= limit) {  // move a alone
      const int64_t score = std::llabs(2 * a - target2);
      if (score < best) { best = score; out.pos_a = i; out.pos_b = -1; }
    }
    // swap with b ~ a - target: the first b with 2b >= 2a - target2, and the one before it
    const int64_t t = (2 * a - target2 + 1) >> 1;  // ceil((2a - target2) / 2), floor semantics
    const int64_t pos = std::lower_bound(B.begin(), B.end(), Item(t, -1)) - B.begin();
    for (int64_t j = pos - 1; j <= pos; ++j) {
      if (j < 0 || j >= static_cast<int64_t>(B.size())) continue;
      const int64_t d = a - B[j].first;
      if (d <= 0 || d > limit) continue;
      const int64_t score = std::llabs(2 * d - target2);
      if (score < best) { best = score; out.pos_a = i; out.pos_b = j; }
    }
    if (best <= floor_score) break;
  }
  return best != std::numeric_limits<int64_t>::max();
}

void insert_sorted(std::vector<Item>& v, const Item& x) {
  v.insert(std::lower_bound(v.begin(), v.end(), x), x);
}

// Apply an exchange between bins hi and lo, keeping loads and the ordered set in sync.
void apply_exchange(std::vector<std::vector<Item>>& bins, std::vector<int64_t>& load, std::set<Key>& order,
                    int64_t hi, int64_t lo, const Exchange& ex) {
  order.erase(Key(load[hi], hi));
  order.erase(Key(load[lo], lo));
  const Item a = bins[hi][ex.pos_a];
  bins[hi].erase(bins[hi].begin() + ex.pos_a);
  load[hi] -= a.first;
  load[lo] += a.first;
  if (ex.pos_b >= 0) {
    const Item b = bins[lo][ex.pos_b];
    bins[lo].erase(bins[lo].begin() + ex.pos_b);
    load[lo] -= b.first;
    load[hi] += b.first;
    insert_sorted(bins[hi], b);
  }
  insert_sorted(bins[lo], a);
  order.insert(Key(load[hi], hi));
  order.insert(Key(load[lo], lo));
}

void lpt(const int64_t* len, int64_t n, int64_t k, std::vector<std::vector<Item>>& bins, std::vector<int64_t>& load) {
  std::vector<int64_t> idx(n);
  for (int64_t i = 0; i < n; ++i) idx[i] = i;
  std::sort(idx.begin(), idx.end(), [len](int64_t x, int64_t y) {
    return len[x] > len[y] || (len[x] == len[y] && x < y);
  });
  std::vector<Key> heap_storage;
  heap_storage.reserve(k);
  for (int64_t b = 0; b < k; ++b) heap_storage.emplace_back(0, b);
  std::priority_queue<Key, std::vector<Key>, std::greater<Key>> heap(std::greater<Key>(), std::move(heap_storage));
  for (int64_t i : idx) {
    Key top = heap.top();
    heap.pop();
    bins[top.second].emplace_back(len[i], i);
    top.first += len[i];
    load[top.second] = top.first;
    heap.push(top);
  }
  for (auto& b : bins) std::sort(b.begin(), b.end());
}

// Fix an over-budget bin `hi` that no balancing exchange helps (typically one long
// sequence plus a short one): the exchange that brings hi within budget while loading the
// partner least.  The partner's excess is then worked off by ordinary exchanges, as it
// usually holds many shorter sequences.  Returns false when no exchange fixes hi.
bool kick(std::vector<std::vector<Item>>& bins, std::vector<int64_t>& load, std::set<Key>& order, int64_t hi,
          int64_t capacity) {
  const int64_t need = load[hi] - capacity;  // shift d >= need
  int64_t best_load = std::numeric_limits<int64_t>::max(), best_lo = -1;
  Exchange best;
  const std::vector<Item>& A = bins[hi];
  for (auto it = order.begin(); it != order.end(); ++it) {
    if (it->second == hi) continue;
    if (it->first + need >= best_load) break;  // ascending loads: nobody later does better
    const std::vector<Item>& B = bins[it->second];
    for (int64_t i = 0; i < static_cast<int64_t>(A.size()); ++i) {
      const int64_t a = A[i].first;
      if (a < need) continue;
      if (it->first + a < best_load) { best_load = it->first + a; best_lo = it->second; best = {i, -1}; }
      // the largest b <= a - need gives the smallest shift that still fixes hi
      const int64_t j = std::upper_bound(B.begin(), B.end(), Item(a - need, std::numeric_limits<int64_t>::max())) -
                        B.begin() - 1;
      if (j >= 0 && it->first + a - B[j].first < best_load) {
        best_load = it->first + a - B[j].first; best_lo = it->second; best = {i, j};
      }
    }
  }
  if (best_lo < 0) return false;
  apply_exchange(bins, load, order, hi, best_lo, best);
  return true;
}

// Best fit decreasing into at most k bins: each item (longest first) goes to the open bin
// whose room fits it most tightly, else a new bin, else (all k open, none fits) the bin
// with the most room.  Under a budget, this packs nearly without waste, which is what
// reaching ceil(total / budget) micro-batches needs; refinement then balances the loads
// without ever pushing a bin over the budget.
void best_fit(const int64_t* len, int64_t n, int64_t k, int64_t capacity, std::vector<std::vector<Item>>& bins,
              std::vector<int64_t>& load) {
  std::vector<int64_t> idx(n);
  for (int64_t i = 0; i < n; ++i) idx[i] = i;
  std::sort(idx.begin(), idx.end(), [len](int64_t x, int64_t y) {
    return len[x] > len[y] || (len[x] == len[y] && x < y);
  });
  std::set<Key> room;  // (room left, bin id) of open bins
  int64_t opened = 0;
  for (int64_t i : idx) {
    auto it = room.lower_bound(Key(len[i], -1));
    int64_t b;
    if (it != room.end()) {
      b = it->second;
      room.erase(it);
    } else if (opened < k) {
      b = opened++;
    } else {
      auto last = std::prev(room.end());
      b = last->second;
      room.erase(last);
    }
    bins[b].emplace_back(len[i], i);
    load[b] += len[i];
    room.insert(Key(capacity - load[b], b));
  }
  for (auto& v : bins) std::sort(v.begin(), v.end());
}

int64_t refine(std::vector<std::vector<Item>>& bins, std::vector<int64_t>& load, int64_t capacity,
               int64_t spread, int64_t max_iters, int64_t max_scan) {
  std::set<Key> order;
  for (int64_t b = 0; b < static_cast<int64_t>(load.size()); ++b) order.insert(Key(load[b], b));
  int64_t iters = 0, kicks = 0;
  // Kicks can cycle when the budget is nearly unreachable; bound them so that a hopeless
  // attempt fails fast and the caller adds a micro-batch instead.
  const int64_t max_kicks = 16 + static_cast<int64_t>(load.size()) / 8;
  for (; iters < max_iters && order.size() > 1; ++iters) {
    const Key top = *order.rbegin();
    // Good enough: within budget and max - min <= spread (polishing further costs time
    // and buys nothing measurable).
    if (top.first - order.begin()->first <= std::max<int64_t>(spread, 1) && top.first <= capacity) break;
    if (top.first - order.begin()->first <= 1) break;
    // Over budget, only exchanges that keep the partner within budget: pushing the excess
    // into a bin that then overflows just moves it, often into a rigid bin (one long
    // sequence plus a short one) that no exchange can fix.
    const bool over = top.first > capacity;
    bool found = false;
    int64_t scanned = 0;
    for (auto it = order.begin(); it != order.end() && scanned < max_scan; ++it, ++scanned) {
      const int64_t gap = top.first - it->first;
      if (gap <= 1) break;
      const int64_t limit = over ? std::min(gap - 1, capacity - it->first) : gap - 1;
      if (limit <= 0) break;
      Exchange ex;
      if (best_exchange(bins[top.second], bins[it->second], gap, limit, ex)) {
        apply_exchange(bins, load, order, top.second, it->second, ex);
        found = true;
        break;
      }
    }
    if (found) continue;
    if (over && kicks < max_kicks && kick(bins, load, order, top.second, capacity)) {
      ++kicks;
      continue;
    }
    // The top bin is as low as exchanges take it: freeze it, keep raising the rest.
    order.erase(top);
  }
  return iters;
}

}  // namespace

// lengths: 1-D int64 tensor (all >= 0); returns (assignment: int64[n] bin per item,
// iterations of refinement used).
std::tuple<torch::Tensor, int64_t> balanced_partition(torch::Tensor lengths, int64_t num_bins, int64_t capacity,
                                                      int64_t spread, int64_t max_iters, int64_t max_scan) {
  TORCH_CHECK(lengths.dim() == 1, "lengths must be 1-D, got ", lengths.dim(), " dims");
  TORCH_CHECK(lengths.scalar_type() == torch::kInt64, "lengths must be int64");
  TORCH_CHECK(num_bins >= 1, "num_bins must be >= 1, got ", num_bins);
  torch::Tensor lens = lengths.contiguous();
  const int64_t n = lens.size(0);
  const int64_t* len = lens.data_ptr<int64_t>();
  std::vector<std::vector<Item>> bins(num_bins);
  std::vector<int64_t> load(num_bins, 0);
  if (capacity < kNoCapacity) {
    best_fit(len, n, num_bins, capacity, bins, load);
  } else {
    lpt(len, n, num_bins, bins, load);
  }
  const int64_t iters = refine(bins, load, capacity, spread, max_iters, max_scan);
  torch::Tensor assign = torch::empty({n}, torch::kInt64);
  int64_t* out = assign.data_ptr<int64_t>();
  for (int64_t b = 0; b < num_bins; ++b)
    for (const Item& it : bins[b]) out[it.second] = b;
  return {assign, iters};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Balanced k-way partition (LPT + exchange refinement) for micro-batch packing";
  m.def("balanced_partition", &balanced_partition, "LPT + max-bin exchange refinement",
        pybind11::arg("lengths"), pybind11::arg("num_bins"),
        pybind11::arg("capacity"), pybind11::arg("spread"), pybind11::arg("max_iters"),
        pybind11::arg("max_scan"));
}
