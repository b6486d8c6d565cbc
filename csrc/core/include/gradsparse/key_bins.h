// KeyBins: which of a few sorted keys an element's key falls under, by a table look-up instead of a
// search (host code: the CPU counting kernel, the band counts of MiCRO and ExDyna, OnePass's counts).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace gradsparse {

/// Sorted keys with a lookup table over their span, so that finding the last j with
/// keys[j] <= key takes a table read and (on average) less than one step. The keys (ascending)
/// must outlive the table.
class KeyBins {
 public:
  /// The table as plain values. Hot loops copy it into a local first (`const auto bins =
  /// table.lookup();`) so that its fields stay in registers: read through the table, they were
  /// loaded again for every key, since the loop's own stores might alias them.
  struct Lookup {
    const uint32_t* keys;
    const int* slot;       ///< per slot: the last j with keys[j] <= the slot's first key
    const uint32_t* next;  ///< per slot: keys[slot + 1], or the largest uint32 past the last key
    uint32_t base;
    int shift;
    size_t last_slot;
    int m;
    bool crowded;  ///< whether some slot holds two keys or more past its first (see bin)

    /// The last j with keys[j] <= key, for keys[0] <= key < 0xffffffff (every magnitude key is
    /// below; next[]'s past the last key is 0xffffffff). The first step past the slot's key
    /// is taken without a branch: where a slot holds a key (MiCRO's band: one slot in ten),
    /// whether a key lies past it is as good as random. Only a crowded table takes further steps.
    /// Over a million band keys (a C++ loop): 4.0 ms through the table's fields with a branch,
    /// 2.8 ms from a local copy without it. MiCRO's band counts over 984 thousand keys, whose
    /// table is not crowded: 3.0 to 3.2 ms with the loop of further steps (which never stepped
    /// there), 1.9 to 2.2 ms without it.
    int bin(uint32_t key) const {
      const size_t t = std::min(static_cast<size_t>((key - base) >> shift), last_slot);
      int j = slot[t] + (key >= next[t] ? 1 : 0);
      if (crowded)
        while (j + 1 < m && keys[j + 1] <= key) ++j;
      return j;
    }
  };

  KeyBins(const uint32_t* keys, int m) : keys_(keys), m_(m) {
    if (m == 0) return;
    base_ = keys[0];
    const uint32_t span = keys[m - 1] - keys[0];
    while ((span >> shift_) >= kSlots) ++shift_;
    slot_.resize(static_cast<size_t>(span >> shift_) + 1);
    next_.resize(slot_.size());
    const size_t last = slot_.size() - 1;
    for (size_t t = 0; t <= last; ++t) {
      const uint32_t start = base_ + (static_cast<uint32_t>(t) << shift_);
      slot_[t] = static_cast<int>(std::upper_bound(keys, keys + m, start) - keys) - 1;
      next_[t] = slot_[t] + 1 < m ? keys[slot_[t] + 1] : std::numeric_limits<uint32_t>::max();
      // the largest key bin() looks up in slot t (the last slot also takes every key past it)
      const uint32_t end = t == last ? std::numeric_limits<uint32_t>::max() : start + ((uint32_t{1} << shift_) - 1);
      crowded_ = crowded_ || (slot_[t] + 2 < m && keys[slot_[t] + 2] <= end);
    }
  }
  Lookup lookup() const {
    return Lookup{keys_, slot_.data(), next_.data(), base_, shift_, slot_.empty() ? 0 : slot_.size() - 1, m_, crowded_};
  }

  /// Counts n keys (each below 0xffffffff, as bin() needs) into m + 1 bins: in_bin[0] += those
  /// below keys[0], in_bin[j + 1] += those at or above keys[j] and below keys[j + 1] (the last
  /// bin: from keys[m - 1] up; with no keys, every key is below). In blocks on the CPU kernels'
  /// threads (host code: not from inside a parallel region); on their AVX-512 path
  /// (kernels/cpu/key_bins.cpp), a table that is not crowded looks up 16 keys a step.
  void count(const uint32_t* keys, int64_t n, int64_t* in_bin) const;
  /// count() of float32 values' keys (Num<float>::key: the bits of |v|).
  void count(const float* values, int64_t n, int64_t* in_bin) const;

 private:
  static constexpr uint32_t kSlots = 4096;
  const uint32_t* keys_;
  int m_;
  uint32_t base_ = 0;
  int shift_ = 0;
  bool crowded_ = false;
  std::vector<int> slot_;
  std::vector<uint32_t> next_;
};

}  // namespace gradsparse
