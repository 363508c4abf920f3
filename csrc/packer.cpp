// Hot loops of the batch planner. Each function has a line-for-line Python twin in
// dflash/data/packing.py; tests compare the two on random inputs.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

void check_lengths(const torch::Tensor& lengths, int64_t budget) {
  TORCH_CHECK(lengths.dim() == 1, "lengths must be 1-D, got ", lengths.dim(), "-D");
  TORCH_CHECK(lengths.scalar_type() == torch::kInt64, "lengths must be int64");
  TORCH_CHECK(lengths.device().is_cpu(), "lengths must be on the CPU");
  TORCH_CHECK(lengths.is_contiguous(), "lengths must be contiguous");
  TORCH_CHECK(budget > 0, "token budget must be positive, got ", budget);
}

// Drafter rows of each stream item: same shape as lengths, each in [0, row_budget].
void check_rows(const torch::Tensor& rows, const torch::Tensor& lengths, int64_t row_budget) {
  TORCH_CHECK(rows.dim() == 1 && rows.size(0) == lengths.size(0), "rows must match lengths");
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && rows.is_contiguous() && rows.device().is_cpu(),
              "rows must be a contiguous int64 CPU tensor");
  TORCH_CHECK(row_budget > 0, "row budget must be positive, got ", row_budget);
}

// Returns offsets (num_batches + 1) splitting the stream into consecutive batches: a batch is
// cut when count x longest would pass `budget` or its rows would pass `row_budget`.
torch::Tensor pad_greedy(torch::Tensor lengths, int64_t budget, torch::Tensor rows, int64_t row_budget) {
  check_lengths(lengths, budget);
  check_rows(rows, lengths, row_budget);
  const int64_t n = lengths.size(0);
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t* row = rows.data_ptr<int64_t>();
  std::vector<int64_t> offsets{0};
  int64_t count = 0, longest = 0, used_rows = 0;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(len[i] > 0 && len[i] <= budget, "stream item ", i, " has length ", len[i],
                " outside [1, budget=", budget, "]");
    TORCH_CHECK(row[i] >= 0 && row[i] <= row_budget, "stream item ", i, " has ", row[i],
                " rows, outside [0, row budget=", row_budget, "]");
    const int64_t new_longest = std::max(longest, len[i]);
    if (count > 0 && ((count + 1) * new_longest > budget || used_rows + row[i] > row_budget)) {
      offsets.push_back(i);
      count = 0;
      longest = len[i];
      used_rows = 0;
    } else {
      longest = new_longest;
    }
    ++count;
    used_rows += row[i];
  }
  if (count > 0) offsets.push_back(n);
  return torch::tensor(offsets, torch::kInt64);
}

// Best fit among at most `window` open bins, fed in stream order. An item goes to the open
// bin with the least token room that still fits its tokens and its rows (earliest opened on
// ties); if none fits, a new bin opens, and when `window` bins are already open the fullest
// one by tokens (earliest on ties) is closed first. Returns (items, offsets): stream
// positions grouped by bin, bins in the order they closed (the leftovers close in opening
// order at the end).
std::vector<torch::Tensor> pack_best_fit(torch::Tensor lengths, int64_t budget, int64_t window,
                                         torch::Tensor rows, int64_t row_budget) {
  check_lengths(lengths, budget);
  check_rows(rows, lengths, row_budget);
  TORCH_CHECK(window >= 1, "window must be >= 1, got ", window);
  const int64_t n = lengths.size(0);
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t* row = rows.data_ptr<int64_t>();

  std::vector<std::vector<int64_t>> bins;                  // items of every bin ever opened
  std::vector<int64_t> open_ids, open_room, open_rows;  // open bins, in opening order
  std::vector<int64_t> closed;                              // bin ids in closing order

  auto close_at = [&](size_t slot) {
    closed.push_back(open_ids[slot]);
    open_ids.erase(open_ids.begin() + slot);
    open_room.erase(open_room.begin() + slot);
    open_rows.erase(open_rows.begin() + slot);
  };

  for (int64_t i = 0; i < n; ++i) {
    const int64_t x = len[i];
    TORCH_CHECK(x > 0 && x <= budget, "stream item ", i, " has length ", x,
                " outside [1, budget=", budget, "]");
    TORCH_CHECK(row[i] >= 0 && row[i] <= row_budget, "stream item ", i, " has ", row[i],
                " rows, outside [0, row budget=", row_budget, "]");
    int64_t best = -1;
    for (size_t s = 0; s < open_room.size(); ++s) {
      if (open_room[s] >= x && open_rows[s] >= row[i] && (best < 0 || open_room[s] < open_room[best])) best = s;
    }
    if (best < 0) {
      if (static_cast<int64_t>(open_ids.size()) == window) {
        size_t fullest = 0;
        for (size_t s = 1; s < open_room.size(); ++s) {
          if (open_room[s] < open_room[fullest]) fullest = s;
        }
        close_at(fullest);
      }
      open_ids.push_back(static_cast<int64_t>(bins.size()));
      open_room.push_back(budget);
      open_rows.push_back(row_budget);
      bins.emplace_back();
      best = static_cast<int64_t>(open_ids.size()) - 1;
    }
    bins[open_ids[best]].push_back(i);
    open_room[best] -= x;
    open_rows[best] -= row[i];
  }
  for (int64_t id : open_ids) closed.push_back(id);

  std::vector<int64_t> items, offsets{0};
  items.reserve(n);
  offsets.reserve(closed.size() + 1);
  for (int64_t id : closed) {
    items.insert(items.end(), bins[id].begin(), bins[id].end());
    offsets.push_back(static_cast<int64_t>(items.size()));
  }
  return {torch::tensor(items, torch::kInt64), torch::tensor(offsets, torch::kInt64)};
}

// Exact minimum of sum over buckets of (samples in bucket) x (bucket's longest length), over
// contiguous partitions of the sorted distinct lengths `values` (with `counts`) into at most
// `k` buckets. The cost (C[j]-C[i]) * v[j] satisfies the quadrangle inequality, so the best
// split point is monotone in j and divide-and-conquer finds it in O(k D log D).
// Returns the index of the last distinct value of each bucket (ascending).
torch::Tensor optimal_partition(torch::Tensor values, torch::Tensor counts, int64_t k) {
  TORCH_CHECK(values.dim() == 1 && counts.dim() == 1 && values.size(0) == counts.size(0),
              "values and counts must be 1-D of equal size");
  TORCH_CHECK(values.scalar_type() == torch::kInt64 && counts.scalar_type() == torch::kInt64,
              "values and counts must be int64");
  TORCH_CHECK(values.is_contiguous() && counts.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(k >= 1, "number of buckets must be >= 1");
  const int64_t d = values.size(0);
  TORCH_CHECK(d >= 1, "no lengths given");
  const int64_t* v = values.data_ptr<int64_t>();
  const int64_t* c = counts.data_ptr<int64_t>();
  k = std::min(k, d);

  std::vector<int64_t> prefix(d + 1, 0);  // prefix[j] = samples with value index < j
  for (int64_t j = 0; j < d; ++j) prefix[j + 1] = prefix[j] + c[j];
  const int64_t inf = std::numeric_limits<int64_t>::max();

  // prev[j]: best cost of values [0, j] with (layer) buckets; argmin[layer][j]: split point.
  std::vector<int64_t> prev(d), cur(d);
  std::vector<std::vector<int64_t>> split(k, std::vector<int64_t>(d, -1));
  for (int64_t j = 0; j < d; ++j) prev[j] = prefix[j + 1] * v[j];

  for (int64_t layer = 1; layer < k; ++layer) {
    // cur[j] = min over i in [layer-1, j-1] of prev[i] + (prefix[j+1]-prefix[i+1]) * v[j]
    struct Frame { int64_t lo, hi, opt_lo, opt_hi; };
    std::vector<Frame> stack{{layer, d - 1, layer - 1, d - 2}};
    for (int64_t j = 0; j < layer; ++j) cur[j] = inf;
    while (!stack.empty()) {
      Frame f = stack.back();
      stack.pop_back();
      if (f.lo > f.hi) continue;
      const int64_t mid = (f.lo + f.hi) / 2;
      int64_t best = inf, best_i = -1;
      const int64_t last = std::min(f.opt_hi, mid - 1);
      for (int64_t i = f.opt_lo; i <= last; ++i) {
        if (prev[i] == inf) continue;
        const int64_t cost = prev[i] + (prefix[mid + 1] - prefix[i + 1]) * v[mid];
        if (cost < best) { best = cost; best_i = i; }
      }
      cur[mid] = best;
      split[layer][mid] = best_i;
      stack.push_back({mid + 1, f.hi, best_i, f.opt_hi});
      stack.push_back({f.lo, mid - 1, f.opt_lo, best_i});
    }
    std::swap(prev, cur);
  }
  // Fewer buckets never cost less, so the k-bucket answer at the last value is optimal.
  std::vector<int64_t> ends(k);
  int64_t j = d - 1;
  for (int64_t layer = k - 1; layer >= 0; --layer) {
    ends[layer] = j;
    if (layer > 0) j = split[layer][j];
  }
  return torch::tensor(ends, torch::kInt64);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dflash batch-planner hot loops (twins of dflash/data/packing.py)";
  m.def("pad_greedy", &pad_greedy, "Greedy padded batching of a stream (count x longest <= budget)",
        py::arg("lengths"), py::arg("budget"), py::arg("rows"), py::arg("row_budget"));
  m.def("pack_best_fit", &pack_best_fit, "Best-fit packing inside a window of open bins",
        py::arg("lengths"), py::arg("budget"), py::arg("window"), py::arg("rows"), py::arg("row_budget"));
  m.def("optimal_partition", &optimal_partition, "Exact padded-cost bucket partition",
        py::arg("values"), py::arg("counts"), py::arg("k"));
}
