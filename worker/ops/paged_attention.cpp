// Paged attention on CPU that reads K/V in place through the block table, for a mixed batch of
// prefill chunks (over cached prefixes) and decode tokens in one call.
//
// cache: [2, kv_heads, num_blocks, block_size, head_size] (K then V); the key at position p of
// request r lives in block block_table[r][p / block_size] at offset p % block_size.
// query_start_loc: [num_reqs + 1] int32; seq_lens: [num_reqs] int32 (keys the last query sees).
// A query at position p sees keys [max(0, p - window + 1), p] (window -1: [0, p]). softcap > 0 caps each
// scaled score s to softcap * tanh(s / softcap) before the softmax (Gemma 2).
//
// The work is split into items: (request, kv head, up to one vector's lanes of (query token, q head)
// rows); the rows of one item share every K/V block they read. Items run largest first on torch's
// intra-op threads, taken from a shared counter. Each item walks the blocks its rows can see with an
// online softmax in fp32: a block per step for wide items, a span of blocks per step for narrow ones.
// Keys outside [first visible key, last query] are never touched, so null blocks (skipped by a sliding
// window) and unwritten slots are never read.
//
// A quantized cache (kv_quant.h: int8 or fp8 codes, one fp32 scale per K/V, kv head and block) is read in
// place the same way: the codes of the blocks in use are widened into a block's or a span's scratch (to bf16,
// exact, where a compile-time head size or the bf16 dot products take them; else to fp32), never the whole
// cache; a block's K scale multiplies its scores and its V scale the probabilities.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_vec.h"
#include "kv_quant.h"
#include "ops.h"

namespace {

inline vint iota() {
  vint v{};
  for (int i = 0; i < kLanes; ++i) v[i] = i;
  return v;
}

// One step of a transposed reduction: lanes [blk*2w, blk*2w + w) of the result sum a's halves of
// width w, lanes [blk*2w + w, (blk+1)*2w) sum b's.
constexpr int half_lane(int w, int i, bool high) {
  const int blk = i / (2 * w), pos = i % (2 * w);
  return (pos < w ? blk * 2 * w + pos : kLanes + blk * 2 * w + pos - w) + (high ? w : 0);
}
template <int W, size_t... I>
inline vfloat fold(vfloat a, vfloat b, std::index_sequence<I...>) {
  return __builtin_shufflevector(a, b, half_lane(W, I, false)...) +
         __builtin_shufflevector(a, b, half_lane(W, I, true)...);
}
template <int W>
inline void fold_tree(vfloat* v) {  // 2W vectors in, W out
  for (int i = 0; i < W; ++i) v[i] = fold<W>(v[2 * i], v[2 * i + 1], std::make_index_sequence<kLanes>{});
  if constexpr (W > 1) fold_tree<W / 2>(v);
}
constexpr int bit_reverse(int i) {
  int r = 0;
  for (int b = 1; b < kLanes; b <<= 1) r = (r << 1) | ((i & b) ? 1 : 0);
  return r;
}
template <size_t... I>
inline vfloat bit_reverse_lanes(vfloat v, std::index_sequence<I...>) {
  return __builtin_shufflevector(v, v, bit_reverse(I)...);
}

// Lane j of the result is the sum of v[j]'s lanes (v is overwritten): kLanes horizontal sums for
// about the cost of one each. The folds leave the sums in bit-reversed lane order.
inline vfloat sum_lanes(vfloat* v) {
  fold_tree<kLanes / 2>(v);
  return bit_reverse_lanes(v[0], std::make_index_sequence<kLanes>{});
}

// sum_lanes for kLanes vectors that each hold two rows' partial sums (lower and upper half): one fold
// level fewer, two vectors out. sums[r] lane j: the sum of v[j]'s half r.
template <int W, int N>
inline void fold_pairs(vfloat* v) {  // N vectors in, N / 2 out
  for (int i = 0; i < N / 2; ++i) v[i] = fold<W>(v[2 * i], v[2 * i + 1], std::make_index_sequence<kLanes>{});
  if constexpr (W > 1) fold_pairs<W / 2, N / 2>(v);
}
constexpr int half_lane_of_key(int r, int j) {  // where the folds leave half r of v[j]
  constexpr int L = kLanes / 2;
  int rev = 0;
  for (int b = 1; b < L; b <<= 1) rev = (rev << 1) | ((j % L) & b ? 1 : 0);
  return (j / L) * kLanes + r * L + rev;
}
template <size_t... I>
inline void sum_lane_pairs(vfloat* v, vfloat* sums, std::index_sequence<I...>) {
  fold_pairs<kLanes / 4, kLanes>(v);
  sums[0] = __builtin_shufflevector(v[0], v[1], half_lane_of_key(0, I)...);
  sums[1] = __builtin_shufflevector(v[0], v[1], half_lane_of_key(1, I)...);
}

constexpr float kMasked = -1e30f;  // score of a key a row cannot see

// acc += p * v over D floats (vectors, then a scalar tail when D is not a multiple of kLanes).
inline void axpy(float* acc, float p, const float* v, int D) {
  const vfloat pv = splat(p);
  int d = 0;
  for (; d + kLanes <= D; d += kLanes) store(acc + d, load(acc + d) + pv * load(v + d));
  for (; d < D; ++d) acc[d] += p * v[d];
}

struct Request {
  int64_t q_start;  // first query's row in q
  int64_t num_computed;
  int64_t seq_len;
  const int32_t* blocks;  // this request's block table row
};

struct Item {
  int32_t req;
  int32_t token0;  // first query token, relative to the request's first query
  int32_t num_tokens;
  int32_t kv_head;
  int32_t head0;  // first q head within the kv head's group
  int32_t num_heads;
  int64_t cost;
};

struct Shape {
  int64_t heads, kv_heads, group, head_size, block_size, num_blocks;
  int64_t q_token_stride, q_head_stride;
  int64_t window;  // <= 0: none
  float scale;
  float softcap;  // <= 0: none
  const float* scales = nullptr;  // a quantized cache's [2, kv_heads, num_blocks] scales
  int32_t quant = kNoQuant;
};

// One thread's scratch, reused across its items; kD == 0: head size known only at run time.
// An item's rows (query token, q head) are kLanes at most. Wide items (prefill tiles) score a key
// for all rows in one vector: queries transposed, one broadcast key element per step. Narrow items
// (decodes: the heads of one kv head) take per-row dot products, kLanes keys at a time, summed
// across lanes by a transposed reduction. Either way, per step: scores, online-softmax step, then
// acc += p * V in fp32 (narrow bf16 items with bf16 dot products: accumulate_paired), K and V of the blocks
// ahead prefetched (blocks are scattered).
// C is the cache's element type: T, or uint8_t for a quantized cache's codes.
template <typename T, typename C, int kD>
class ItemRunner {
 public:
  ItemRunner(const Shape& s, const T* q, const C* cache, T* out)
      : s_(s), d_(kD > 0 ? kD : static_cast<int>(s.head_size)), q_(q), cache_(cache), out_(out),
        span_blocks_(std::max<int64_t>(1, kSpanKeys / s.block_size)),
        key_stride_(static_cast<int>(span_blocks_ * s.block_size) + kLanes),
        prefetch_blocks_(std::clamp<int64_t>(kPrefetchBytes / (s.block_size * s.head_size * sizeof(C)), 1, 8)),
        queries_(static_cast<size_t>(d_) * kLanes),
        scores_(static_cast<size_t>(key_stride_) * kLanes), acc_(static_cast<size_t>(kLanes) * d_),
        kf_(std::is_same_v<C, float> ? 0 : static_cast<size_t>(s.block_size) * d_), vf_(kf_.size()),
        dot_(kDotT && d_ % 32 == 0), qbits_(dot_ ? static_cast<size_t>(d_) * kLanes : 0), qpairs_(qbits_.size()),
        codes_(code_reader(s.quant)), kbf_(kQuant && dot_ ? static_cast<size_t>(s.block_size) * d_ : 0),
        vbf_(kQuant && kInRegisters ? static_cast<size_t>(span_blocks_ * s.block_size) * d_ : 0),
        pbf_(kPairedPV ? static_cast<size_t>(key_stride_) * 2 * kLanes : 0) {}


  void run(const Item& it, const Request& rq) {
    const int64_t BS = s_.block_size;
    rows_ = it.num_tokens * it.num_heads;
    wide_ = 2 * rows_ > kLanes;
    int64_t lo_min = std::numeric_limits<int64_t>::max(), hi_max = -1;
    for (int m = 0; m < kLanes; ++m) {
      if (m < rows_) {
        const int64_t pos = rq.num_computed + it.token0 + m / it.num_heads;
        lo_[m] = static_cast<int32_t>(s_.window > 0 ? std::max<int64_t>(0, pos - s_.window + 1) : 0);
        hi_[m] = static_cast<int32_t>(pos);
        lo_min = std::min<int64_t>(lo_min, lo_[m]);
        hi_max = std::max<int64_t>(hi_max, hi_[m]);
      } else {
        lo_[m] = std::numeric_limits<int32_t>::max();
        hi_[m] = -1;
      }
      max_[m] = kMasked;
      sum_[m] = 0.0f;
    }
    seen_by_all_lo_ = 0;
    seen_by_all_hi_ = std::numeric_limits<int32_t>::max();
    for (int m = 0; m < rows_; ++m) {
      seen_by_all_lo_ = std::max(seen_by_all_lo_, lo_[m]);
      seen_by_all_hi_ = std::min(seen_by_all_hi_, hi_[m]);
    }
    load_queries(it, rq);
    std::fill(acc_.begin(), acc_.end(), 0.0f);
    const int64_t D = d(), kv_stride = s_.num_blocks * BS * D;  // one kv head of K (or V)
    const C* k_head = cache_ + it.kv_head * kv_stride;
    const C* v_head = cache_ + (s_.kv_heads + it.kv_head) * kv_stride;
    if constexpr (kQuant) {
      k_scales_ = s_.scales + it.kv_head * s_.num_blocks;
      v_scales_ = s_.scales + (s_.kv_heads + it.kv_head) * s_.num_blocks;
    }
    lo_min_ = lo_min;
    hi_max_ = hi_max;
    const int64_t first = lo_min / BS, last = hi_max / BS;
    auto block_of = [&](const C* head, int64_t b) { return head + rq.blocks[b] * BS * D; };
    if (wide_) {
      for (int64_t b = first; b < std::min(first + prefetch_blocks_, last + 1); ++b) {
        prefetch(block_of(k_head, b), BS * D);
        prefetch(block_of(v_head, b), BS * D);
      }
      for (int64_t b = first; b <= last; ++b) {
        if (b + prefetch_blocks_ <= last) {
          prefetch(block_of(k_head, b + prefetch_blocks_), BS * D);
          prefetch(block_of(v_head, b + prefetch_blocks_), BS * D);
        }
        const int64_t base = b * BS;
        const int j0 = key_begin(b), j1 = key_end(b);
        const C* k = block_of(k_head, b);
        const C* v = block_of(v_head, b);
        if (dot_) {
          dot_scale_ = s_.scale * k_scale(rq, b);
          score_wide_dot(dot_keys(k, j0, j1), static_cast<int32_t>(base), j0, j1);
        } else {
          score_wide(as_float(k, j0, j1, kf_, k_scale(rq, b)), static_cast<int32_t>(base), j0, j1);
        }
        if constexpr (kInRegisters) {
          accumulate_in_registers(v_head, rq, b, b + 1, -1, 1, kLanes);  // last -1: the loop prefetches V
        } else {
          accumulate(as_float(v, j0, j1, vf_, v_scale(rq, b)), scores_.data(), j0, j1, 1, kLanes);
        }
      }
    } else {
      // A span of blocks at a time: scores of all its keys, one online-softmax step, then P x V. The
      // next span's blocks are prefetched a key at a time as this span's are read (a burst of
      // prefetches would stall on the line fill buffers): K while scoring, V while accumulating.
      for (int64_t b = first; b < std::min(first + prefetch_blocks_, last + 1); ++b) {
        prefetch(block_of(k_head, b), BS * D);
      }
      for (int64_t b0 = first; b0 <= last; b0 += span_blocks_) {
        const int64_t b1 = std::min(last + 1, b0 + span_blocks_);
        for (int64_t b = b0; b < b1; ++b) {
          const C* k = block_of(k_head, b);
          const C* ahead = b + span_blocks_ <= last ? block_of(k_head, b + span_blocks_) : nullptr;
          dot_scale_ = s_.scale * k_scale(rq, b);
          score_narrow(dot_ ? nullptr : as_float(k, key_begin(b), key_end(b), kf_, k_scale(rq, b)),
                       dot_ ? dot_keys(k, key_begin(b), key_end(b)) : nullptr, static_cast<int32_t>(b * BS),
                       key_begin(b), key_end(b), static_cast<int>((b - b0) * BS), ahead,
                       b0 == first ? block_of(v_head, b) : nullptr);
        }
        softmax_step_narrow(key_begin(b0), static_cast<int>((b1 - 1 - b0) * BS) + key_end(b1 - 1));
        if constexpr (kPairedPV) {
          accumulate_paired(v_head, rq, b0, b1, last);
        } else if constexpr (kInRegisters) {
          accumulate_in_registers(v_head, rq, b0, b1, last, key_stride_, 1);
        } else {
          for (int64_t b = b0; b < b1; ++b) {
            if (b + span_blocks_ <= last) prefetch(block_of(v_head, b + span_blocks_), BS * D);
            const float* v = as_float(block_of(v_head, b), key_begin(b), key_end(b), vf_, v_scale(rq, b));
            accumulate(v, scores_.data() + (b - b0) * BS, key_begin(b), key_end(b), key_stride_, 1);
            std::fill(alpha_, alpha_ + kLanes, 1.0f);  // the span's rescale, applied with its first block
          }
        }
      }
    }
    store_out(it, rq);
  }

 private:
  static constexpr int64_t kPrefetchBytes = 4096;  // of K (and as much of V) ahead of the block in use
  static constexpr int64_t kSpanKeys = 64;         // narrow items' keys per online-softmax step
  // bf16 on CPUs with AVX512-BF16: scores by bf16 dot products read straight from the cache, queries kept
  // unscaled in bf16 (exact) and the scale applied to the fp32 scores.
  // A quantized cache takes that path too, a block's codes widened to bf16 (exact) and its scale applied to the scores.
  static constexpr bool kQuant = std::is_same_v<C, uint8_t>;
  static constexpr bool kDotT = std::is_same_v<T, c10::BFloat16> && (std::is_same_v<C, T> || kQuant) && kBf16Dot;
  using DotT = std::conditional_t<kQuant, c10::BFloat16, C>;  // the keys the bf16 dot products read

  // Keys [j0, j1) of a block for the dot products: the cache itself, or a quantized block's codes as bf16 in scratch.
  const DotT* dot_keys(const C* src, int j0, int j1) {
    if constexpr (kQuant) {
      const int64_t D = d();
      codes_to_bf16(src + j0 * D, kbf_.data() + j0 * D, (j1 - j0) * D, codes_);
      return reinterpret_cast<const DotT*>(kbf_.data());
    } else {
      return src;
    }
  }

  // A quantized block's K (V) scale, the code reader's factor folded in; 1 unquantized.
  float k_scale(const Request& rq, int64_t b) const { return kQuant ? k_scales_[rq.blocks[b]] * codes_.mult : 1.0f; }
  float v_scale(const Request& rq, int64_t b) const { return kQuant ? v_scales_[rq.blocks[b]] * codes_.mult : 1.0f; }

  int d() const { return kD > 0 ? kD : d_; }

  // The keys of block column b that some row sees: [key_begin(b), key_end(b)) within the block.
  int key_begin(int64_t b) const {
    return static_cast<int>(std::max<int64_t>(lo_min_, b * s_.block_size) - b * s_.block_size);
  }
  int key_end(int64_t b) const {
    return static_cast<int>(std::min<int64_t>(hi_max_ + 1, (b + 1) * s_.block_size) - b * s_.block_size);
  }

  // Into L2 (prefetcht1), not L1: measured on a 360M-shaped decode layer with its K/V in DRAM, 1.75 ms against
  // 2.65 ms with L1 prefetches (bench/attention_bench.py's decode step: 1.28x).
  template <typename U>
  static void prefetch(const U* p, int64_t n) {
    const char* c = reinterpret_cast<const char*>(p);
    for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(U)); i += 64) __builtin_prefetch(c + i, 0, 2);
  }

  // Scaled queries: wide items as [D][kLanes] (padding rows zero), narrow ones as [rows][D]. With dot_,
  // the unscaled bf16 bits instead: wide items as [D / 2][kLanes][2] (pairs of a row), narrow ones as [rows][D].
  void load_queries(const Item& it, const Request& rq) {
    const int D = d();
    if (wide_ && !dot_) std::fill(queries_.begin(), queries_.end(), 0.0f);
    if (wide_ && dot_) std::fill(qbits_.begin(), qbits_.end(), uint16_t{0});
    for (int m = 0; m < rows_; ++m) {
      const int64_t token = rq.q_start + it.token0 + m / it.num_heads;
      const int64_t head = it.kv_head * s_.group + it.head0 + m % it.num_heads;
      const T* src = q_ + token * s_.q_token_stride + head * s_.q_head_stride;
      if (dot_ && wide_) {  // a pair of bf16 values is one 32-bit lane
        for (int i = 0; i < D; i += 2) std::memcpy(qbits_.data() + ((i / 2) * kLanes + m) * 2, src + i, 4);
      } else if (dot_) {
        std::memcpy(qbits_.data() + m * D, src, D * sizeof(T));
        for (int c = 0; c < D; c += kLanes) {  // rows paired for score_row_pair
          std::memcpy(qpairs_.data() + (m / 2) * 2 * D + 2 * c + (m % 2) * kLanes, src + c, kLanes * sizeof(T));
        }
      } else {
        for (int i = 0; i < D; ++i) queries_[wide_ ? i * kLanes + m : m * D + i] = to_float(src[i]) * s_.scale;
      }
    }
  }

  // Keys [j0, j1) of a block as fp32: the cache itself for fp32, else converted (codes: dequantized) into scratch.
  const float* as_float(const C* src, int j0, int j1, std::vector<float>& buf, float scale) {
    if constexpr (std::is_same_v<C, float>) {
      return src;
    } else if constexpr (kQuant) {
      const int64_t D = d();
      codes_to_float(src + j0 * D, buf.data() + j0 * D, (j1 - j0) * D, codes_, scale);
      return buf.data();
    } else {
      const int64_t D = d();
      to_float(src + j0 * D, buf.data() + j0 * D, (j1 - j0) * D);
      return buf.data();
    }
  }

  // scores_[j * kLanes + row] for keys [j0, j1), masked; then the online-softmax step for all rows.
  void score_wide(const float* k, int32_t base, int j0, int j1) {
    const int D = d();
    const vint lo = load_int(lo_), hi = load_int(hi_);
    const bool seen = seen_by_all(base, j0, j1);
    vfloat block_max = splat(kMasked);
    int j = j0;
    for (; j + 4 <= j1; j += 4) {  // four keys per pass over the queries: fewer loads per FMA
      const float* kj = k + static_cast<int64_t>(j) * D;
      vfloat s0{}, s1{}, s2{}, s3{};
      for (int i = 0; i < D; ++i) {
        const vfloat qi = load(queries_.data() + i * kLanes);
        s0 += qi * kj[i];
        s1 += qi * kj[D + i];
        s2 += qi * kj[2 * D + i];
        s3 += qi * kj[3 * D + i];
      }
      block_max = vmax(block_max, mask_and_store(s0, base, j, lo, hi, seen));
      block_max = vmax(block_max, mask_and_store(s1, base, j + 1, lo, hi, seen));
      block_max = vmax(block_max, mask_and_store(s2, base, j + 2, lo, hi, seen));
      block_max = vmax(block_max, mask_and_store(s3, base, j + 3, lo, hi, seen));
    }
    for (; j < j1; ++j) {
      const float* kj = k + static_cast<int64_t>(j) * D;
      vfloat s{};
      for (int i = 0; i < D; ++i) s += load(queries_.data() + i * kLanes) * kj[i];
      block_max = vmax(block_max, mask_and_store(s, base, j, lo, hi, seen));
    }
    softmax_step_wide(block_max, j0, j1, seen);
  }

  // score_wide from bf16 keys: per pair of key elements, one vdpbf16ps for every row.
  void score_wide_dot(const DotT* k, int32_t base, int j0, int j1) {
    if constexpr (kDotT) {
      const int D = d();
      const vint lo = load_int(lo_), hi = load_int(hi_);
      const vfloat scale = splat(dot_scale_);
      const bool seen = seen_by_all(base, j0, j1);
      vfloat block_max = splat(kMasked);
      int j = j0;
      for (; j + 4 <= j1; j += 4) {
        const DotT* kj = k + static_cast<int64_t>(j) * D;
        vfloat s0{}, s1{}, s2{}, s3{};
        for (int i = 0; i < D; i += 2) {
          const uint16_t* qi = qbits_.data() + i * kLanes;
          s0 = dot_bf16_pair(s0, qi, pair(kj + i));
          s1 = dot_bf16_pair(s1, qi, pair(kj + D + i));
          s2 = dot_bf16_pair(s2, qi, pair(kj + 2 * D + i));
          s3 = dot_bf16_pair(s3, qi, pair(kj + 3 * D + i));
        }
        block_max = vmax(block_max, mask_and_store(s0 * scale, base, j, lo, hi, seen));
        block_max = vmax(block_max, mask_and_store(s1 * scale, base, j + 1, lo, hi, seen));
        block_max = vmax(block_max, mask_and_store(s2 * scale, base, j + 2, lo, hi, seen));
        block_max = vmax(block_max, mask_and_store(s3 * scale, base, j + 3, lo, hi, seen));
      }
      for (; j < j1; ++j) {
        const DotT* kj = k + static_cast<int64_t>(j) * D;
        vfloat s{};
        for (int i = 0; i < D; i += 2) s = dot_bf16_pair(s, qbits_.data() + i * kLanes, pair(kj + i));
        block_max = vmax(block_max, mask_and_store(s * scale, base, j, lo, hi, seen));
      }
      softmax_step_wide(block_max, j0, j1, seen);
    }
  }

  static uint32_t pair(const DotT* p) {  // two adjacent bf16 values as one 32-bit lane
    uint32_t b;
    std::memcpy(&b, p, sizeof(b));
    return b;
  }

  // Whether every row sees keys [base + j0, base + j1): then nothing in the block is masked.
  bool seen_by_all(int32_t base, int j0, int j1) const {
    return base + j0 >= seen_by_all_lo_ && base + j1 - 1 <= seen_by_all_hi_;
  }

  // The online-softmax step of every row over the block's scores, for wide items (seen: none masked).
  void softmax_step_wide(vfloat block_max, int j0, int j1, bool seen) {
    const vfloat old_max = load(max_), new_max = vmax(old_max, block_max);
    const vfloat alpha = exp_nonpos(old_max - new_max);
    vfloat sum = load(sum_) * alpha;
    for (int j = j0; j < j1; ++j) {
      const vfloat x = load(scores_.data() + j * kLanes);
      const vfloat p = seen ? exp_nonpos(x - new_max) : x == kMasked ? vfloat{} : exp_nonpos(x - new_max);
      sum += p;
      store(scores_.data() + j * kLanes, p);
    }
    store(max_, new_max);
    store(alpha_, alpha);
    store(sum_, sum);
  }

  // The soft-capped score (unchanged without a cap).
  vfloat cap(vfloat s) const { return s_.softcap > 0 ? soft_cap(s, s_.softcap) : s; }

  vfloat mask_and_store(vfloat s, int32_t base, int j, vint lo, vint hi, bool seen) {
    s = cap(s);
    if (!seen) {
      const vint pos = splat_int(base + j);
      s = (pos >= lo) & (pos <= hi) ? s : splat(kMasked);
    }
    store(scores_.data() + j * kLanes, s);
    return s;
  }

  // scores_[row * key_stride_ + off + j] for keys [j0, j1) of a block, masked: per row, kLanes keys at a
  // time. Keys as fp32 (k), or with dot_ the block's bf16 keys (kb). The same keys of blocks ahead1 and
  // ahead2 (where not null) are prefetched along the way.
  void score_narrow(const float* k, const DotT* kb, int32_t base, int j0, int j1, int off, const C* ahead1,
                    const C* ahead2) {
    const int D = d();
    int m = 0;
    if (dot_) {
      for (; m + 2 <= rows_; m += 2) score_row_pair(kb, base, j0, j1, off, m, m == 0 ? ahead1 : nullptr,
                                                    m == 0 ? ahead2 : nullptr);
    }
    for (; m < rows_; ++m) {
      const float* q = queries_.data() + m * D;
      float* sc = scores_.data() + m * key_stride_ + off;
      for (int jc = j0; jc < j1; jc += kLanes) {
        vfloat part[kLanes];
        for (int i = 0; i < kLanes; ++i) {
          if (m == 0 && jc + i < j1) {
            if (ahead1) prefetch(ahead1 + static_cast<int64_t>(jc + i) * D, D);
            if (ahead2) prefetch(ahead2 + static_cast<int64_t>(jc + i) * D, D);
          }
          if (jc + i >= j1) {
            part[i] = vfloat{};
          } else if (dot_) {
            part[i] = partial_dot_bf16(qbits_.data() + m * D, kb + static_cast<int64_t>(jc + i) * D);
          } else {
            part[i] = partial_dot(q, k + static_cast<int64_t>(jc + i) * D);
          }
        }
        vfloat x = sum_lanes(part);
        if (dot_) x *= dot_scale_;
        x = cap(x);
        const vint pos = splat_int(base + jc) + iota();
        x = (pos >= lo_[m]) & (pos <= hi_[m]) & (pos < base + j1) ? x : splat(kMasked);
        store(sc + jc, x);
      }
    }
  }

  // score_narrow for rows m and m + 1 with dot_: each key's half-vector chunks broadcast against both rows'
  // queries side by side, so one vector holds two rows' partial sums and the folds are shared.
  void score_row_pair(const DotT* kb, int32_t base, int j0, int j1, int off, int m, const C* ahead1, const C* ahead2) {
    if constexpr (kDotT) {
      const int D = d();
      const uint16_t* qp = qpairs_.data() + (m / 2) * 2 * D;  // [D / 16][row m's 16 values, row m + 1's]
      for (int jc = j0; jc < j1; jc += kLanes) {
        vfloat part[kLanes];
        for (int i = 0; i < kLanes; ++i) {
          const int64_t j = jc + i;
          if (j >= j1) {
            part[i] = vfloat{};
            continue;
          }
          if (ahead1) prefetch(ahead1 + j * D, D);
          if (ahead2) prefetch(ahead2 + j * D, D);
          vfloat acc{};
          for (int c = 0; c < D; c += kLanes) acc = dot_bf16_half(acc, qp + 2 * c, kb + j * D + c);
          part[i] = acc;
        }
        vfloat x[2];
        sum_lane_pairs(part, x, std::make_index_sequence<kLanes>{});
        const vint pos = splat_int(base + jc) + iota();
        for (int r = 0; r < 2; ++r) {
          const vfloat y = (pos >= lo_[m + r]) & (pos <= hi_[m + r]) & (pos < base + j1) ? cap(x[r] * dot_scale_)
                                                                                          : splat(kMasked);
          store(scores_.data() + (m + r) * key_stride_ + off + jc, y);
        }
      }
    }
  }

  // The online-softmax step of every row over a span's scores [start, end) (narrow items); lanes past
  // end hold whatever a block's last vector left there and are ignored.
  void softmax_step_narrow(int start, int end) {
    for (int m = 0; m < rows_; ++m) {
      float* sc = scores_.data() + m * key_stride_;
      vfloat block_max = splat(kMasked);
      for (int jc = start; jc < end; jc += kLanes) {
        const vfloat x = load(sc + jc);
        block_max = vmax(block_max, splat_int(jc) + iota() < end ? x : splat(kMasked));
      }
      const float new_max = std::max(max_[m], hmax(block_max));
      alpha_[m] = std::exp(max_[m] - new_max);
      max_[m] = new_max;
      vfloat sum{};
      for (int jc = start; jc < end; jc += kLanes) {
        const vfloat x = load(sc + jc);
        const vfloat p = x == kMasked || splat_int(jc) + iota() >= end ? vfloat{} : exp_nonpos(x - new_max);
        sum += p;
        store(sc + jc, p);
      }
      sum_[m] = sum_[m] * alpha_[m] + hsum(sum);
    }
  }

  // partial_dot of unscaled bf16 q and bf16 k (D a multiple of 32).
  vfloat partial_dot_bf16(const uint16_t* q, const DotT* k) const {
    vfloat acc{};
    if constexpr (kDotT) {
      for (int i = 0; i < d(); i += 32) acc = dot_bf16(acc, q + i, k + i);
    }
    return acc;
  }

  // Lane-wise products of q and k summed over D's vector chunks (a tail, if any, into lane 0).
  vfloat partial_dot(const float* q, const float* k) const {
    const int D = d();
    vfloat acc{};
    int i = 0;
    for (; i + kLanes <= D; i += kLanes) acc += load(q + i) * load(k + i);
    for (; i < D; ++i) acc[0] += q[i] * k[i];
    return acc;
  }

  // A compile-time head size: P x V by accumulate_in_registers (else by accumulate, through fp32 scratch).
  static constexpr bool kInRegisters = kD > 0 && kD % kLanes == 0;

  static vfloat load_as_float(const DotT* p) {
    if constexpr (std::is_same_v<DotT, float>) {
      return load(p);
    } else if constexpr (std::is_same_v<DotT, c10::BFloat16>) {
      return load_bf16(p);
    } else {
      vfloat x;
      for (int i = 0; i < kLanes; ++i) x[i] = static_cast<float>(p[i]);
      return x;
    }
  }

  // accumulate with V read once per key for a block of rows: each key's V chunks are loaded (bf16 widened in
  // registers) and added into kR rows' accumulators in fp32; when that makes fewer than 8 independent FMA
  // chains, even and odd keys get accumulators of their own, summed at the end. Block columns [b0, b1), p(row,
  // key t of the span) at scores_[row * row_stride + t * key_stride]; the first pass over V prefetches the
  // next span's V (up to block column last).
  void accumulate_in_registers(const C* v_head, const Request& rq, int64_t b0, int64_t b1, int64_t last,
                               int row_stride, int key_stride) {
    if constexpr (kInRegisters) {
      widen_v_codes(v_head, rq, b0, b1);
      constexpr int kRows = std::clamp(16 / (kD / kLanes), 1, 4);
      const int rs = row_stride, ks = key_stride;
      int m0 = 0;
      for (; m0 + kRows <= rows_; m0 += kRows) accumulate_rows<kRows>(v_head, rq, b0, b1, m0, last, rs, ks);
      if constexpr (kRows > 2) {
        if (m0 + 2 <= rows_) {
          accumulate_rows<2>(v_head, rq, b0, b1, m0, last, rs, ks);
          m0 += 2;
        }
      }
      if constexpr (kRows > 1) {
        if (m0 < rows_) accumulate_rows<1>(v_head, rq, b0, b1, m0, last, rs, ks);
      }
    }
  }

  // A quantized cache: the V codes of block columns [b0, b1) as bf16 in vbf_, once for every group of rows.
  void widen_v_codes(const C* v_head, const Request& rq, int64_t b0, int64_t b1) {
    if constexpr (kQuant) {
      for (int64_t b = b0; b < b1; ++b) {
        const C* from = v_head + (rq.blocks[b] * s_.block_size + key_begin(b)) * kD;
        codes_to_bf16(from, vbf_.data() + ((b - b0) * s_.block_size + key_begin(b)) * kD,
                      (key_end(b) - key_begin(b)) * kD, codes_);
      }
    }
  }

  // Narrow items with bf16 dot products: P x V two keys per vdpbf16ps, the two keys' V rows interleaved once for all
  // rows. Each probability is split into two bf16 terms (hi + lo: fp32 to about 2^-17), so P x V stays as exact as
  // fp32 products summed in fp32, for two dot products a pair instead of one.
  static constexpr bool kPairedPV = kDotT && kD > 0 && kD % 32 == 0;

  void accumulate_paired(const C* v_head, const Request& rq, int64_t b0, int64_t b1, int64_t last) {
    if constexpr (kPairedPV) {
      widen_v_codes(v_head, rq, b0, b1);
      round_probabilities(rq, b0, b1);
      constexpr int kRows = std::max(1, 8 / (kD / 32));  // 2 * kRows * kD / 32 accumulators: 16 registers
      int m0 = 0;
      for (; m0 + kRows <= rows_; m0 += kRows) accumulate_pairs<kRows>(v_head, rq, b0, b1, m0, last);
      accumulate_pairs_tail<kRows - 1>(v_head, rq, b0, b1, m0, last);
    }
  }

  template <int kR>
  void accumulate_pairs_tail(const C* v_head, const Request& rq, int64_t b0, int64_t b1, int m0, int64_t last) {
    if constexpr (kR > 0) {
      if (rows_ - m0 == kR) {
        accumulate_pairs<kR>(v_head, rq, b0, b1, m0, last);
      } else {
        accumulate_pairs_tail<kR - 1>(v_head, rq, b0, b1, m0, last);
      }
    }
  }

  // pbf_[(2 * row + 0 or 1) * key_stride_ + t]: the probability of the span's key t, times its block's V scale, as
  // store_bf16_split's hi and lo terms.
  void round_probabilities(const Request& rq, int64_t b0, int64_t b1) {
    if constexpr (kPairedPV) {
      for (int m = 0; m < rows_; ++m) {
        for (int64_t b = b0; b < b1; ++b) {  // in order: a block's last vector may spill into the next block's keys
          const int64_t off = (b - b0) * s_.block_size;
          const float* sc = scores_.data() + m * key_stride_ + off;
          uint16_t* hi = pbf_.data() + 2 * m * key_stride_ + off;
          const vfloat vs = splat(v_scale(rq, b));
          for (int j = key_begin(b); j < key_end(b); j += kLanes) {
            store_bf16_split(hi + j, hi + key_stride_ + j, load(sc + j) * vs);
          }
        }
      }
    }
  }

  // Rows [m0, m0 + kR) of accumulate_paired: lo/hi accumulators in interleave_bf16's lane order, put back in
  // value order when added into acc_.
  template <int kR>
  void accumulate_pairs(const C* v_head, const Request& rq, int64_t b0, int64_t b1, int m0, int64_t last) {
    constexpr int kC = kD / 32;
    vfloat lo[kR][kC] = {}, hi[kR][kC] = {};
    for (int64_t b = b0; b < b1; ++b) {
      const C* ahead = m0 == 0 ? v_ahead(v_head, rq, b, last) : nullptr;  // the first group of rows prefetches
      const DotT* v = v_rows(v_head, rq, b, b0);
      const uint16_t* p = pbf_.data() + 2 * m0 * key_stride_ + (b - b0) * s_.block_size;
      const int j1 = key_end(b);
      for (int j = key_begin(b); j < j1; j += 2) {  // keys j and j + 1 (two), or j alone
        const bool two = j + 1 < j1;
        if (ahead) prefetch(ahead + static_cast<int64_t>(j) * kD, 2 * kD);
        uint32_t pm[kR][2];  // row m's probabilities of the keys as bf16 pairs: the hi terms, the lo terms
        for (int m = 0; m < kR; ++m) {
          for (int t = 0; t < 2; ++t) {
            const uint16_t* pj = p + (2 * m + t) * key_stride_ + j;
            pm[m][t] = pj[0] | (two ? uint32_t{pj[1]} << 16 : 0);
          }
        }
#pragma GCC unroll 8
        for (int c = 0; c < kC; ++c) {
          vint vlo, vhi;
          const DotT* vj = v + static_cast<int64_t>(j) * kD + c * 32;
          interleave_bf16(vj, vj + kD, two, vlo, vhi);
#pragma GCC unroll 8
          for (int m = 0; m < kR; ++m) {
            lo[m][c] = dot_bf16_bits(dot_bf16_bits(lo[m][c], vlo, pm[m][0]), vlo, pm[m][1]);
            hi[m][c] = dot_bf16_bits(dot_bf16_bits(hi[m][c], vhi, pm[m][0]), vhi, pm[m][1]);
          }
        }
      }
    }
    for (int m = 0; m < kR; ++m) {
      float* acc = acc_.data() + (m0 + m) * kD;
      const float alpha = alpha_[m0 + m];
      for (int c = 0; c < kC; ++c) {
        store(acc + c * 32, load(acc + c * 32) * alpha + deinterleave<true>(lo[m][c], hi[m][c]));
        store(acc + c * 32 + kLanes, load(acc + c * 32 + kLanes) * alpha + deinterleave<false>(lo[m][c], hi[m][c]));
      }
    }
  }

  // The V block a span ahead of block column b, to prefetch while b is read (null past the last column).
  const C* v_ahead(const C* v_head, const Request& rq, int64_t b, int64_t last) const {
    return b + span_blocks_ <= last ? v_head + rq.blocks[b + span_blocks_] * s_.block_size * kD : nullptr;
  }

  // Block column b's V rows for accumulate_rows: the cache block, or a quantized block's bf16 copy in vbf_.
  const DotT* v_rows(const C* v_head, const Request& rq, int64_t b, int64_t b0) const {
    if constexpr (kQuant) {
      return reinterpret_cast<const DotT*>(vbf_.data()) + (b - b0) * s_.block_size * kD;
    } else {
      return v_head + rq.blocks[b] * s_.block_size * kD;
    }
  }

  template <int kR>
  void accumulate_rows(const C* v_head, const Request& rq, int64_t b0, int64_t b1, int m0, int64_t last,
                       int row_stride, int key_stride) {
    constexpr int kC = kD / kLanes, kS = kR * kC >= 8 ? 1 : 2;
    vfloat r[kS][kR][kC];
    for (int m = 0; m < kR; ++m) {
      for (int c = 0; c < kC; ++c) {
        r[0][m][c] = load(acc_.data() + (m0 + m) * kD + c * kLanes) * alpha_[m0 + m];
        if constexpr (kS > 1) r[1][m][c] = vfloat{};
      }
    }
    for (int64_t b = b0; b < b1; ++b) {
      const C* ahead = m0 == 0 ? v_ahead(v_head, rq, b, last) : nullptr;  // the first group of rows prefetches
      const DotT* v = v_rows(v_head, rq, b, b0);
      const float vs = v_scale(rq, b);
      const float* p = scores_.data() + m0 * row_stride + (b - b0) * s_.block_size * key_stride;
      auto add_key = [&](vfloat(&rs)[kR][kC], int j) {
        const DotT* vj = v + static_cast<int64_t>(j) * kD;
        if (ahead) prefetch(ahead + static_cast<int64_t>(j) * kD, kD);
        float pm[kR];  // p(row, j), times the block's V scale when quantized
        for (int m = 0; m < kR; ++m) {
          pm[m] = p[m * row_stride + j * key_stride];
          if constexpr (kQuant) pm[m] *= vs;
        }
#pragma GCC unroll 8
        for (int c = 0; c < kC; ++c) {
          const vfloat vc = load_as_float(vj + c * kLanes);
#pragma GCC unroll 4
          for (int m = 0; m < kR; ++m) rs[m][c] += splat(pm[m]) * vc;
        }
      };
      const int j1 = key_end(b);
      int j = key_begin(b);
      for (; j + kS <= j1; j += kS) {
        add_key(r[0], j);
        if constexpr (kS > 1) add_key(r[1], j + 1);
      }
      if (j < j1) add_key(r[0], j);
    }
    for (int m = 0; m < kR; ++m) {
      for (int c = 0; c < kC; ++c) {
        vfloat x = r[0][m][c];
        if constexpr (kS > 1) x += r[1][m][c];
        store(acc_.data() + (m0 + m) * kD + c * kLanes, x);
      }
    }
  }

  // acc[row] = alpha[row] * acc[row] + sum_j p(row, j) V[j], with p(row, j) at
  // scores[row * row_stride + j * key_stride] (wide items: 1, kLanes; narrow ones: key_stride_, 1).
  void accumulate(const float* v, const float* scores, int j0, int j1, int row_stride, int key_stride) {
    const int D = d();
    for (int m = 0; m < rows_; ++m) {
      float* acc = acc_.data() + static_cast<int64_t>(m) * D;
      const float* p = scores + m * row_stride;
      for (int i = 0; i < D; ++i) acc[i] *= alpha_[m];
      for (int j = j0; j < j1; ++j) axpy(acc, p[j * key_stride], v + static_cast<int64_t>(j) * D, D);
    }
  }

  void store_out(const Item& it, const Request& rq) {
    const int D = d();
    for (int m = 0; m < rows_; ++m) {
      const int64_t token = rq.q_start + it.token0 + m / it.num_heads;
      const int64_t head = it.kv_head * s_.group + it.head0 + m % it.num_heads;
      T* dst = out_ + (token * s_.heads + head) * D;
      const float inv = 1.0f / sum_[m];
      const float* acc = acc_.data() + static_cast<int64_t>(m) * D;
      for (int i = 0; i < D; ++i) dst[i] = static_cast<T>(acc[i] * inv);
    }
  }

  static vint load_int(const int32_t* p) {
    vint v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }

  const Shape& s_;
  const int d_;
  const T* q_;
  const C* cache_;
  T* out_;
  const int64_t span_blocks_;  // narrow items: blocks per online-softmax step
  const int key_stride_;       // narrow scores: a row's keys of a span, padded to whole vectors
  const int64_t prefetch_blocks_;
  std::vector<float> queries_, scores_, acc_, kf_, vf_;
  const bool dot_;
  std::vector<uint16_t> qbits_, qpairs_;  // with dot_: bf16 queries; narrow ones again with rows paired
  int rows_ = 0;
  bool wide_ = false;
  int32_t lo_[kLanes], hi_[kLanes];  // per row: first and last visible key position
  int32_t seen_by_all_lo_ = 0, seen_by_all_hi_ = -1;  // the keys every row sees
  int64_t lo_min_ = 0, hi_max_ = -1;                   // the keys some row sees
  float max_[kLanes], sum_[kLanes], alpha_[kLanes];
  const CodeReader codes_;
  std::vector<uint16_t> kbf_;  // quantized with dot_: a block's keys as bf16
  std::vector<uint16_t> vbf_;  // quantized, V in registers: a span's V as bf16
  std::vector<uint16_t> pbf_;  // kPairedPV: each row's probabilities of a span as two bf16 terms
  float dot_scale_ = 0.0f;     // with dot_: the score scale times the block's K scale
  const float* k_scales_ = nullptr;  // quantized: this item's kv head's scales, by block id
  const float* v_scales_ = nullptr;
};

// Items of one request: its query tokens in tiles, per kv head (and per head chunk when the group
// is wider than kLanes). Cost ~ rows x keys seen, to run the largest first.
void add_items(std::vector<Item>& items, const Shape& s, int32_t r, int64_t num_queries, int64_t num_computed) {
  const int64_t heads_per_item = std::min<int64_t>(s.group, kLanes);
  const int64_t tokens_per_item = std::max<int64_t>(1, kLanes / heads_per_item);
  for (int64_t t0 = 0; t0 < num_queries; t0 += tokens_per_item) {
    const int64_t nt = std::min(tokens_per_item, num_queries - t0);
    const int64_t last = num_computed + t0 + nt - 1;
    const int64_t first = s.window > 0 ? std::max<int64_t>(0, num_computed + t0 - s.window + 1) : 0;
    for (int64_t kvh = 0; kvh < s.kv_heads; ++kvh) {
      for (int64_t h0 = 0; h0 < s.group; h0 += heads_per_item) {
        const int64_t nh = std::min(heads_per_item, s.group - h0);
        items.push_back({r, static_cast<int32_t>(t0), static_cast<int32_t>(nt), static_cast<int32_t>(kvh),
                         static_cast<int32_t>(h0), static_cast<int32_t>(nh), (last - first + 1) * (nt * nh + 4)});
      }
    }
  }
}

// Requests from the metadata, checked: every block the call touches (the visible keys' blocks, or
// with new_only the new tokens' blocks) is a real block, not the null block 0.
std::vector<Request> read_requests(const at::Tensor& block_table, const at::Tensor& query_start_loc,
                                   const at::Tensor& seq_lens, int64_t num_tokens, const Shape& s,
                                   bool new_only) {
  TORCH_CHECK(block_table.is_cpu() && query_start_loc.is_cpu() && seq_lens.is_cpu(), "metadata must be on the CPU");
  TORCH_CHECK(block_table.dtype() == at::kInt && query_start_loc.dtype() == at::kInt &&
                  seq_lens.dtype() == at::kInt,
              "block_table, query_start_loc and seq_lens must be int32");
  TORCH_CHECK(block_table.dim() == 2 && block_table.stride(1) == 1,
              "block_table must be [num_reqs, max_blocks], rows contiguous");
  const int64_t num_reqs = seq_lens.numel();
  TORCH_CHECK(query_start_loc.numel() == num_reqs + 1, "query_start_loc must have num_reqs + 1 entries");
  TORCH_CHECK(block_table.size(0) >= num_reqs, "block_table has fewer rows than requests");
  auto qsl = query_start_loc.contiguous();
  auto lens = seq_lens.contiguous();
  const int32_t* qs = qsl.data_ptr<int32_t>();
  const int32_t* sl = lens.data_ptr<int32_t>();
  TORCH_CHECK(qs[0] == 0 && qs[num_reqs] == num_tokens, "query_start_loc must run from 0 to the number of tokens");
  const int32_t* table = block_table.data_ptr<int32_t>();
  std::vector<Request> reqs(num_reqs);
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t nq = qs[r + 1] - qs[r];
    TORCH_CHECK(nq >= 0 && sl[r] >= nq, "request ", r, ": ", nq, " queries but seq_len ", sl[r]);
    TORCH_CHECK(sl[r] <= block_table.size(1) * s.block_size, "request ", r, ": seq_len ", sl[r],
                " exceeds its block table row");
    const int64_t nc = sl[r] - nq;
    const int32_t* row = table + r * block_table.stride(0);
    const int64_t first = new_only ? nc : s.window > 0 ? std::max<int64_t>(0, nc - s.window + 1) : 0;
    for (int64_t c = first / s.block_size; nq > 0 && c <= (sl[r] - 1) / s.block_size; ++c) {
      TORCH_CHECK(row[c] > 0 && row[c] < s.num_blocks, "request ", r, ": block table column ", c, " holds block ",
                  row[c], ", not a real block (1..", s.num_blocks - 1, ")");
    }
    reqs[r] = {qs[r], nc, sl[r], row};
  }
  return reqs;
}

// A quantized cache's format from its dtype (kNoQuant: not one).
int32_t quant_of(const at::Tensor& cache) {
  switch (cache.scalar_type()) {
    case at::kChar: return kInt8;
    case at::kFloat8_e4m3fn: return kFp8E4M3;
    case at::kFloat8_e5m2: return kFp8E5M2;
    default: return kNoQuant;
  }
}

Shape read_shape(const at::Tensor& q, const at::Tensor& cache, int64_t window, double scale, double softcap,
                 const std::optional<at::Tensor>& kv_scales) {
  TORCH_CHECK(q.device().is_cpu() && cache.device().is_cpu(), "paged_attention_cpu: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [tokens, heads, head_size] with contiguous heads");
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous(),
              "cache must be a contiguous [2, kv_heads, num_blocks, block_size, head_size] tensor");
  TORCH_CHECK(kv_scales.has_value() || q.scalar_type() == cache.scalar_type(), "q and cache must share a dtype");
  TORCH_CHECK(q.size(2) == cache.size(4), "q and cache head sizes differ");
  TORCH_CHECK(q.size(1) % cache.size(1) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(window == -1 || window > 0, "window must be -1 (none) or positive");
  Shape s{q.size(1), cache.size(1), q.size(1) / cache.size(1), q.size(2), cache.size(3), cache.size(2),
          q.stride(0), q.stride(1), window, static_cast<float>(scale), static_cast<float>(softcap)};
  if (kv_scales.has_value()) {
    const at::Tensor& sc = *kv_scales;
    s.quant = quant_of(cache);
    TORCH_CHECK(s.quant != kNoQuant, "a cache with scales must be int8, float8_e4m3fn or float8_e5m2");
    TORCH_CHECK(sc.is_cpu() && sc.scalar_type() == at::kFloat && sc.is_contiguous() && sc.dim() == 3 &&
                    sc.size(0) == 2 && sc.size(1) == s.kv_heads && sc.size(2) == s.num_blocks,
                "kv_scales must be a contiguous fp32 [2, kv_heads, num_blocks] tensor");
    s.scales = sc.data_ptr<float>();
  }
  return s;
}

template <typename T, typename C, int kD>
void run_items(const Shape& s, const std::vector<Item>& items, const std::vector<Request>& reqs, const T* q,
               const C* cache, T* out) {
  std::atomic<size_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size()));
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      ItemRunner<T, C, kD> runner(s, q, cache, out);
      for (size_t i = next.fetch_add(1); i < items.size(); i = next.fetch_add(1)) {
        runner.run(items[i], reqs[items[i].req]);
      }
    }
  });
}

template <typename T, typename C>
void dispatch_head_size(const Shape& s, const std::vector<Item>& items, const std::vector<Request>& reqs,
                        const T* q, const C* cache, T* out) {
  switch (s.head_size) {
    case 32: return run_items<T, C, 32>(s, items, reqs, q, cache, out);
    case 64: return run_items<T, C, 64>(s, items, reqs, q, cache, out);
    case 128: return run_items<T, C, 128>(s, items, reqs, q, cache, out);
    default: return run_items<T, C, 0>(s, items, reqs, q, cache, out);
  }
}

// Quantized writes: per request, per block its new tokens reach, per K/V and kv head, the block's new rows.
template <typename T>
void write_quantized(const Shape& s, const std::vector<Request>& reqs, const at::Tensor& k, const at::Tensor& v,
                     at::Tensor& cache) {
  const int64_t D = s.head_size, BS = s.block_size, kv_stride = s.num_blocks * BS * D;
  uint8_t* codes = static_cast<uint8_t*>(cache.data_ptr());
  float* scales = const_cast<float*>(s.scales);
  at::parallel_for(0, static_cast<int64_t>(reqs.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> rows(BS * D);
    for (int64_t r = begin; r < end; ++r) {
      const Request& rq = reqs[r];
      for (int64_t pos = rq.num_computed; pos < rq.seq_len;) {
        const int64_t start = pos % BS, n = std::min(BS - start, rq.seq_len - pos);
        const int64_t block = rq.blocks[pos / BS], t0 = rq.q_start + pos - rq.num_computed;
        for (int64_t i = 0; i < 2 * s.kv_heads; ++i) {  // K's heads, then V's
          const at::Tensor& x = i < s.kv_heads ? k : v;
          const int64_t h = i % s.kv_heads;
          for (int64_t t = 0; t < n; ++t) {
            to_float(x.data_ptr<T>() + (t0 + t) * x.stride(0) + h * x.stride(1), rows.data() + t * D, D);
          }
          quantize_into_block(rows.data(), n, D, start, codes + i * kv_stride + block * BS * D,
                              scales + i * s.num_blocks + block, s.quant);
        }
        pos += n;
      }
    }
  });
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_table,
                              const at::Tensor& query_start_loc, const at::Tensor& seq_lens, int64_t window,
                              double scale, double softcap, const std::optional<at::Tensor>& kv_scales) {
  const Shape s = read_shape(q, cache, window, scale, softcap, kv_scales);
  const std::vector<Request> reqs = read_requests(block_table, query_start_loc, seq_lens, q.size(0), s, false);
  std::vector<Item> items;
  for (int32_t r = 0; r < static_cast<int32_t>(reqs.size()); ++r) {
    add_items(items, s, r, reqs[r].seq_len - reqs[r].num_computed, reqs[r].num_computed);
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  auto out = at::empty({q.size(0), s.heads * s.head_size}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_cpu", [&] {
    if (s.quant != kNoQuant) {
      dispatch_head_size<scalar_t, uint8_t>(s, items, reqs, q.data_ptr<scalar_t>(),
                                            static_cast<const uint8_t*>(cache.data_ptr()), out.data_ptr<scalar_t>());
    } else {
      dispatch_head_size<scalar_t, scalar_t>(s, items, reqs, q.data_ptr<scalar_t>(), cache.data_ptr<scalar_t>(),
                                             out.data_ptr<scalar_t>());
    }
  });
  return out;
}

// Writes this step's K/V ([tokens, kv_heads, head_size]) at their slots, found through the block table
// (quantized, with kv_scales, for a quantized cache).
void reshape_and_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& cache,
                       const at::Tensor& block_table, const at::Tensor& query_start_loc,
                       const at::Tensor& seq_lens, const std::optional<at::Tensor>& kv_scales) {
  TORCH_CHECK(k.dim() == 3 && k.stride(2) == 1 && v.sizes() == k.sizes() && v.stride(2) == 1,
              "k and v must be [tokens, kv_heads, head_size] with contiguous heads");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (kv_scales.has_value() || k.scalar_type() == cache.scalar_type()),
              "k, v and cache must share a dtype");
  const Shape s = read_shape(k, cache, -1, 1.0, 0.0, kv_scales);
  TORCH_CHECK(k.size(1) == s.kv_heads, "k must have the cache's kv heads");
  const std::vector<Request> reqs = read_requests(block_table, query_start_loc, seq_lens, k.size(0), s, true);
  if (s.quant != kNoQuant) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "reshape_and_cache_cpu", [&] {
      write_quantized<scalar_t>(s, reqs, k, v, cache);
    });
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "reshape_and_cache_cpu", [&] {
    const int64_t D = s.head_size, BS = s.block_size, kv_stride = s.num_blocks * BS * D;
    scalar_t* dst = cache.data_ptr<scalar_t>();
    const scalar_t* ks = k.data_ptr<scalar_t>();
    const scalar_t* vs = v.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(reqs.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const Request& rq = reqs[r];
        for (int64_t t = 0; t < rq.seq_len - rq.num_computed; ++t) {
          const int64_t pos = rq.num_computed + t;
          const int64_t slot = static_cast<int64_t>(rq.blocks[pos / BS]) * BS + pos % BS;
          for (int64_t h = 0; h < s.kv_heads; ++h) {
            const int64_t src = (rq.q_start + t) * s.q_token_stride + h * s.q_head_stride;
            std::copy_n(ks + src, D, dst + h * kv_stride + slot * D);
            std::copy_n(vs + (rq.q_start + t) * v.stride(0) + h * v.stride(1), D,
                        dst + (s.kv_heads + h) * kv_stride + slot * D);
          }
        }
      }
    });
  });
}
