// KeyBins: which of a few sorted keys an element's key falls under, by a table look-up instead of a
// search (host code: the CPU counting kernel and the band counts of MiCRO and ExDyna).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace gradsparse {

/// Sorted keys with a lookup table over their span, so that finding the last j with
/// keys[j] <= key takes a table read and (on average) less than one step. The keys (ascending)
/// must outlive the table.
class KeyBins {
 public:
  KeyBins(const uint32_t* keys, int m) : keys_(keys), m_(m) {
    if (m == 0) return;
    base_ = keys[0];
    const uint32_t span = keys[m - 1] - keys[0];
    while ((span >> shift_) >= kSlots) ++shift_;
    slot_.resize(static_cast<size_t>(span >> shift_) + 1);
    for (size_t t = 0; t < slot_.size(); ++t) {
      const uint32_t start = base_ + (static_cast<uint32_t>(t) << shift_);
      slot_[t] = static_cast<int>(std::upper_bound(keys, keys + m, start) - keys) - 1;
    }
  }
  /// The last j with keys[j] <= key, for key >= keys[0].
  int bin(uint32_t key) const {
    const size_t t = std::min(static_cast<size_t>((key - base_) >> shift_), slot_.size() - 1);
    int j = slot_[t];
    while (j + 1 < m_ && keys_[j + 1] <= key) ++j;
    return j;
  }

 private:
  static constexpr uint32_t kSlots = 4096;
  const uint32_t* keys_;
  int m_;
  uint32_t base_ = 0;
  int shift_ = 0;
  std::vector<int> slot_;
};

}  // namespace gradsparse
