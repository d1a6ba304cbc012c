// Paged decode attention for XLA:CPU, an XLA FFI custom call (see cpu_paged_attention.py).
//
// Same contract as `paged_decode_attention_partials_reference` (pallas_kernels/mosaic_attention.py):
//   q        f32[B, H, D]                 query heads; head h reads KV head h / (H / H_kv)
//   k_pages  f32|bf16[num_pages, H_kv, P, D]
//   v_pages  same as k_pages
//   table    s32[B, max_pages]            token t of row b: page table[b, t / P] (clipped), slot t % P
//   lengths  s32[B]                       row b attends its first clamp(lengths[b], 0, max_pages*P) tokens
//   scale    f32 attribute                logits = (q . k) * scale
//   max_threads  i64 attribute            rows split over at most this many threads of XLA's
//                                         intra-op pool (0: the pool's size), when worth it
//   out      f32[B, H, D]                 softmax-weighted sum of V (zeros for an empty row)
//   lse      f32[B, H]                    log-sum-exp of the logits (-inf for an empty row)
//
// Why a kernel: XLA:CPU's gather copies each request's pages into a contiguous buffer at about half
// the speed of a memcpy and the products then read that copy back (docs/performance.md, "Where
// decode time goes"). Here each page is read where it lies, once for K and once for V, and nothing
// is copied. The two passes follow the reference's formulation (logits, max, log-sum-exp, then
// softmax times V; exp(l - max) / sum for the reference's exp(l - lse)), so results differ from it
// only by float summation order and rounding of exp / log (~1e-7 relative). Slots past a row's
// length are never read, as the reference masks them (garbage or NaN there does not leak).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <utility>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// A page's K or V block (count floats) as floats: f32 pages are read in place; bf16 (the high half
// of a float32) is widened into `scratch`.
inline const float* as_floats(const float* block, float*, int64_t) { return block; }
inline const float* as_floats(const uint16_t* block, float* scratch, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t bits = static_cast<uint32_t>(block[i]) << 16;
    std::memcpy(scratch + i, &bits, sizeof(float));
  }
  return scratch;
}

// exp(x) for x <= 0 (a logit minus its row's maximum), in a form the compiler vectorizes (libm's
// expf is a scalar call, ~1/3 of this kernel's time at SmolLM2's shapes): Cephes' expf, x = n ln2
// + r with |r| <= ln2 / 2, a degree-6 polynomial for exp(r), 2^n from the exponent bits; ~1 ulp.
// Below -87 (exp < 2^-126, a normal float's floor) it returns 0.
inline float exp_nonpositive(float x) {
  const float clamped = std::max(x, -87.0f);
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
  const float r = (clamped - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.0f ? 0.0f : e * scale;
}

// One (request, KV head) row: G query heads over n tokens. q, out: [G, D]; lse: [G].
// kD: the head dim as a compile-time constant (64, 128: loops fully unrolled, a head's query and
// output accumulator held in vector registers across a page), or 0 for any D.
template <int kD, typename T>
void attend_row(const float* q, const T* k_pages, const T* v_pages, const int32_t* table, int64_t n,
                int64_t num_pages, int64_t page_stride, int64_t head_offset, int64_t P, int64_t D_runtime,
                int64_t G, float scale, float* logits /* [G, n] */, float* row /* [P, D] */, float* out,
                float* lse) {
  const int64_t D = kD ? kD : D_runtime;
  std::fill(out, out + G * D, 0.0f);
  if (n <= 0) {
    std::fill(lse, lse + G, -std::numeric_limits<float>::infinity());
    return;
  }
  std::vector<float> maxima(G, -std::numeric_limits<float>::infinity());
  const int64_t pages = (n + P - 1) / P;
  for (int64_t j = 0; j < pages; ++j) {  // logits, page by page: a page's K [P, D] is read from DRAM once
    const int64_t page = std::clamp<int64_t>(table[j], 0, num_pages - 1);
    const int64_t slots = std::min<int64_t>(P, n - j * P);
    const float* block = as_floats(k_pages + page * page_stride + head_offset, row, slots * D);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float* l = logits + g * n + j * P;
      float m = maxima[g];
      for (int64_t t = 0; t < slots; ++t) {
        const float* key = block + t * D;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += qg[d] * key[d];
        l[t] = s * scale;
        m = std::max(m, l[t]);
      }
      maxima[g] = m;
    }
  }
  for (int64_t g = 0; g < G; ++g) {  // lse = max + log(sum exp(l - max)), as jax.nn.logsumexp
    float* l = logits + g * n;
    const float m = std::isfinite(maxima[g]) ? maxima[g] : 0.0f;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      l[i] = exp_nonpositive(l[i] - m);
      sum += l[i];
    }
    lse[g] = std::log(sum) + m;
    // The reference's exp(l - lse) is exp(l - m) / sum up to rounding: one exp a logit, not two.
    const float inverse = 1.0f / sum;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) l[i] *= inverse;  // probabilities
  }
  for (int64_t j = 0; j < pages; ++j) {  // softmax x V, page by page
    const int64_t page = std::clamp<int64_t>(table[j], 0, num_pages - 1);
    const int64_t slots = std::min<int64_t>(P, n - j * P);
    const float* block = as_floats(v_pages + page * page_stride + head_offset, row, slots * D);
    for (int64_t g = 0; g < G; ++g) {
      const float* p = logits + g * n + j * P;
      float* o = out + g * D;
      float acc[kD ? kD : 1];
      float* a = kD ? acc : o;  // kD: accumulate in registers, add to out once a page
      if (kD) std::fill(acc, acc + D, 0.0f);
      for (int64_t t = 0; t < slots; ++t) {
        const float* value = block + t * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += p[t] * value[d];
      }
      if (kD) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] += acc[d];
      }
    }
  }
}

// Rows (request, KV head) are claimed from an atomic counter by the calling thread and by up to
// `workers - 1` tasks on XLA's intra-op pool. The caller waits only for rows another thread has
// claimed (running, never queued), so a busy pool cannot deadlock it; a task that starts after the
// last row was claimed returns without touching the buffers (the state it reads is shared-owned).
struct RowQueue {
  std::atomic<int64_t> next{0}, done{0};
  std::mutex mutex;
  std::condition_variable finished;
};

// Runs `make_task()(i)` for every i in [0, items) on the calling thread and `workers - 1` tasks of
// the pool (see RowQueue). `make_task` is copied into each task and called once per thread that
// claims an item: the callable it returns holds that thread's scratch. Everything either reads
// must be owned by value or by shared_ptr (a late task may run after the caller returned).
template <typename MakeTask>
void run_items(ffi::ThreadPool& pool, int64_t workers, int64_t items, MakeTask make_task) {
  auto queue = std::make_shared<RowQueue>();
  auto work = [=]() {
    int64_t i = queue->next.fetch_add(1);
    if (i >= items) return;
    auto task = make_task();
    for (; i < items; i = queue->next.fetch_add(1)) {
      task(i);
      if (queue->done.fetch_add(1) + 1 == items) {
        std::lock_guard<std::mutex> lock(queue->mutex);
        queue->finished.notify_all();
      }
    }
  };
  for (int64_t t = 1; t < std::min(workers, items); ++t) pool.Schedule(decltype(work)(work));  // a copy per task
  work();
  std::unique_lock<std::mutex> lock(queue->mutex);
  queue->finished.wait(lock, [&] { return queue->done.load() == items; });
}

template <typename T>
void attend(ffi::ThreadPool& pool, int64_t max_workers, const float* q, const T* k_pages, const T* v_pages,
            const int32_t* table, const int32_t* lengths, int64_t B, int64_t H, int64_t D, int64_t num_pages,
            int64_t H_kv, int64_t P, int64_t max_pages, float scale, float* out, float* lse) {
  const int64_t G = H / H_kv, capacity = max_pages * P, page_stride = H_kv * P * D, rows = B * H_kv;
  // A task pays a wake-up (~10 us); split only rows worth several of those (~16K key-head reads).
  int64_t tokens = 0;
  for (int64_t b = 0; b < B; ++b) tokens += std::clamp<int64_t>(lengths[b], 0, capacity) * H_kv;
  const int64_t workers = std::min({max_workers, rows, 1 + tokens / 16384});
  run_items(pool, workers, rows, [=]() {
    return [=, logits = std::vector<float>(G * capacity), row = std::vector<float>(P * D)](int64_t r) mutable {
      const int64_t b = r / H_kv, h = r % H_kv, first = b * H + h * G;  // query heads h*G .. h*G+G-1 of row b
      const int64_t n = std::clamp<int64_t>(lengths[b], 0, capacity);
      auto row_fn = D == 64 ? attend_row<64, T> : D == 128 ? attend_row<128, T> : attend_row<0, T>;
      row_fn(q + first * D, k_pages, v_pages, table + b * max_pages, n, num_pages, page_stride, h * P * D, P, D, G,
             scale, logits.data(), row.data(), out + first * D, lse + first);
    };
  });
}

ffi::Error PagedDecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                                    ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> table,
                                    ffi::Buffer<ffi::S32> lengths, float scale, int64_t max_threads,
                                    ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), td = table.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || k_pages.element_type() != v_pages.element_type() ||
      v_pages.dimensions().size() != 4) {
    return ffi::Error::InvalidArgument("jkv paged attention: expects q [B, H, D], pages [num_pages, H_kv, P, D]");
  }
  const int64_t B = qd[0], H = qd[1], D = qd[2], num_pages = kd[0], H_kv = kd[1], P = kd[2];
  if (kd[3] != D || H_kv <= 0 || H % H_kv != 0 || td[0] != B || num_pages <= 0) {
    return ffi::Error::InvalidArgument("jkv paged attention: shapes disagree (D, H % H_kv, B, num_pages)");
  }
  float* o = out->typed_data();
  float* l = lse->typed_data();
  const int64_t workers = std::max<int64_t>(1, max_threads > 0 ? max_threads : pool.num_threads());
  switch (k_pages.element_type()) {
    case ffi::F32:
      attend(pool, workers, q.typed_data(), static_cast<const float*>(k_pages.untyped_data()),
             static_cast<const float*>(v_pages.untyped_data()), table.typed_data(), lengths.typed_data(), B, H, D,
             num_pages, H_kv, P, td[1], scale, o, l);
      break;
    case ffi::BF16:
      attend(pool, workers, q.typed_data(), static_cast<const uint16_t*>(k_pages.untyped_data()),
             static_cast<const uint16_t*>(v_pages.untyped_data()), table.typed_data(), lengths.typed_data(), B, H,
             D, num_pages, H_kv, P, td[1], scale, o, l);
      break;
    default:
      return ffi::Error::InvalidArgument("jkv paged attention: pages must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// Causal prefill attention (the contract of models.transformer.prefill_attention):
//   q          f32[B, T, H, D]     query heads; head h reads KV head h / (H / H_kv)
//   k, v       f32[B, H_kv, T, D]  the prompt's keys and values
//   positions  s32[B, T]           query t of row b sees keys j <= positions[b, t] and j < lengths[b]
//   lengths    s32[B]
//   scale      f32 attribute       logits = (q . k) * scale
//   max_threads i64 attribute      tiles split over at most this many threads (0: the pool's size)
//   out        f32[B, T, H, D]     softmax-weighted sum of V (zeros for a query that sees no key)
//
// Why a kernel: XLA:CPU runs the blocked online-softmax formulation (128 x 128 blocks in a loop) on
// one thread at ~40 GFLOP/s: 125 ms a layer of SmolLM2 at 2K tokens, where torch's causal SDPA takes
// 55 (docs/performance.md, "Prefill attention"). Here a tile of kRows query rows (token, head) is
// scored against 8 keys at a time from a transposed copy of K (kRows x 8 accumulators in vector
// registers), softmaxed in full (two passes: max, then exp and sum), and multiplied by V 8 head dims
// at a time; tiles are spread over XLA's intra-op pool, the costliest (last tokens) first.

typedef float v8f __attribute__((vector_size(32)));    // 8 floats: the compiler picks the target's vectors
typedef int32_t v8i __attribute__((vector_size(32)));
constexpr int kRows = 12;                                // query rows of a tile (12 accumulators + 2 live)

inline v8f load8(const float* p) {
  v8f x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
inline void store8(float* p, v8f x) { std::memcpy(p, &x, sizeof x); }
inline v8f splat8(float x) { return v8f{} + x; }

// exp_nonpositive on 8 lanes at once, in vector types (the scalar form's floor and bit casts keep
// the compiler from vectorizing a loop of it): round to nearest by adding and subtracting 1.5 * 2^23.
inline v8f exp8_nonpositive(v8f x) {
  const v8f lo = splat8(-87.0f);
  const v8i keep = x >= lo;  // lanes below -87 give 0
  const v8f c = x < lo ? lo : x;
  const v8f magic = splat8(12582912.0f);
  const v8f n = (c * 1.44269504088896341f + magic) - magic;
  const v8f r = (c - n * 0.693359375f) - n * -2.12194440e-4f;
  v8f p = splat8(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const v8f e = p * r * r + r + 1.0f;
  const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  v8f scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const v8i out = reinterpret_cast<const v8i&>(static_cast<const v8f&>(e * scale)) & keep;
  v8f result;
  std::memcpy(&result, &out, sizeof result);
  return result;
}

// One tile: rows (token t, head g) i0 .. i0 + rows - 1 of (b, KV head h), t-major.
//   q_row[r]  -> the row's query [D]; out_row[r] -> its output [D]; limit[r] keys visible (<= n).
//   kt: K of (b, h) in panels of 8 keys, [Tp / 8, D, 8]; vb: V [T, D] of (b, h); scores: scratch
//   [kRows, Tp]; probs: scratch [64, kRows] at least.
template <int kD>
void prefill_tile(const float* const* q_row, float* const* out_row, const int64_t* limit, int rows, int64_t n,
                  const float* kt, int64_t Tp, const float* vb, int64_t D_runtime, float scale, float* scores,
                  float* probs) {
  const int64_t D = kD ? kD : D_runtime;
  const int64_t n8 = (n + 7) / 8 * 8;
  float qt[(kD ? kD : 256) * kRows];  // the tile's queries [D, kRows]: one base pointer, fixed offsets
  for (int r = 0; r < kRows; ++r)
    for (int64_t d = 0; d < D; ++d) qt[d * kRows + r] = q_row[r][d];
  for (int64_t j0 = 0; j0 < n8; j0 += 8) {  // scores[r, j] = (q_r . k_j) * scale
    v8f acc[kRows] = {};
    const float* panel = kt + j0 * D;  // 8 keys x D, contiguous
    for (int64_t d = 0; d < D; ++d) {
      const v8f kv = load8(panel + d * 8);
      for (int r = 0; r < kRows; ++r) acc[r] += kv * qt[d * kRows + r];
    }
    for (int r = 0; r < kRows; ++r) store8(scores + r * Tp + j0, acc[r] * scale);
  }
  float inverse[kRows];
  for (int r = 0; r < kRows; ++r) {  // softmax numerators, transposed into probs [j, r]; 0 past the limit
    float* s = scores + r * Tp;
    const int64_t m_r = r < rows ? limit[r] : 0;
    float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < m_r; ++j) m = std::max(m, s[j]);
    std::fill(s + m_r, s + n8, -std::numeric_limits<float>::infinity());  // exp8 gives 0 there
    v8f sum8 = {};
    for (int64_t j0 = 0; j0 < n8; j0 += 8) {
      const v8f e = exp8_nonpositive(load8(s + j0) - m);
      sum8 += e;
      store8(s + j0, e);
    }
    float sum = 0.0f;
    for (int i = 0; i < 8; ++i) sum += sum8[i];
    inverse[r] = m_r > 0 ? 1.0f / sum : 0.0f;
  }
  // out[r, :] = sum_j p[r, j] v[j, :] / sum_r, over blocks of kBlock keys whose V rows (16 KB at
  // D = 64) stay in L1 across the passes over the head dims (16 at a time, half the rows a pass);
  // a pass over all n keys a time streamed V from L2 8 times and ran at half the scores' speed.
  constexpr int64_t kBlock = 64;
  float acc_out[kRows * (kD ? kD : 256)];
  std::fill(acc_out, acc_out + kRows * D, 0.0f);
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t nb = std::min(kBlock, n - j0);
    for (int64_t j = 0; j < nb; ++j)  // the block's probabilities [j, r]: one base pointer a key
      for (int r = 0; r < kRows; ++r) probs[j * kRows + r] = scores[r * Tp + j0 + j];
    const float* vblk = vb + j0 * D;
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      for (int half = 0; half < kRows; half += kRows / 2) {
        v8f lo[kRows / 2], hi[kRows / 2];
        for (int r = 0; r < kRows / 2; ++r) {
          lo[r] = load8(acc_out + (half + r) * D + d0);
          hi[r] = load8(acc_out + (half + r) * D + d0 + 8);
        }
        for (int64_t j = 0; j < nb; ++j) {
          const v8f v_lo = load8(vblk + j * D + d0), v_hi = load8(vblk + j * D + d0 + 8);
          const float* p = probs + j * kRows + half;
          for (int r = 0; r < kRows / 2; ++r) {
            lo[r] += v_lo * p[r];
            hi[r] += v_hi * p[r];
          }
        }
        for (int r = 0; r < kRows / 2; ++r) {
          store8(acc_out + (half + r) * D + d0, lo[r]);
          store8(acc_out + (half + r) * D + d0 + 8, hi[r]);
        }
      }
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; ++d) out_row[r][d] = acc_out[r * D + d] * inverse[r];
}

// Runs the tiles of every (b, KV head h) over its first key_counts[b] keys (clamped to [0, N]),
// which `locate(b, h, j)` finds as (K row, V row) of D floats each. Those keys are first copied
// into per-(b, h) scratch: K in panels of 8 keys [n / 8, D, 8] (the scores read 8 keys a load from
// one contiguous panel; a [D, T] transpose made 64 strided streams, 3x slower) and V as rows.
template <typename Locate>
void attend_causal(ffi::ThreadPool& pool, int64_t max_workers, const float* q, const int32_t* positions,
                   const int32_t* key_counts, int64_t B, int64_t T, int64_t H, int64_t H_kv, int64_t D, int64_t N,
                   float scale, float* out, Locate locate) {
  const int64_t G = H / H_kv, BH = B * H_kv;
  std::vector<int64_t> keys(B), offset(BH + 1, 0);  // offset: (b, h)'s scratch, in floats
  for (int64_t b = 0; b < B; ++b) keys[b] = std::clamp<int64_t>(key_counts[b], 0, N);
  for (int64_t bh = 0; bh < BH; ++bh) offset[bh + 1] = offset[bh] + (keys[bh / H_kv] + 7) / 8 * 8 * D;
  auto kt = std::shared_ptr<float[]>(new float[std::max<int64_t>(1, offset[BH])]);
  auto vr = std::shared_ptr<float[]>(new float[std::max<int64_t>(1, offset[BH])]);
  for (int64_t bh = 0; bh < BH; ++bh) {
    const int64_t b = bh / H_kv, h = bh % H_kv, n = keys[b], n8 = (n + 7) / 8 * 8;
    float* k_dst = kt.get() + offset[bh];
    float* v_dst = vr.get() + offset[bh];
    if (n8 > n) std::fill(k_dst + (n8 - 8) * D, k_dst + n8 * D, 0.0f);  // the last panel's unused keys
    for (int64_t j = 0; j < n; ++j) {
      const auto [k_row, v_row] = locate(b, h, j);
      float* panel = k_dst + (j / 8) * 8 * D + j % 8;
      for (int64_t d = 0; d < D; ++d) panel[d * 8] = k_row[d];
      std::memcpy(v_dst + j * D, v_row, D * sizeof(float));
    }
  }
  const int64_t tiles = (T * G + kRows - 1) / kRows, items = BH * tiles;
  auto keys_shared = std::make_shared<std::vector<int64_t>>(std::move(keys));
  auto offsets = std::make_shared<std::vector<int64_t>>(std::move(offset));
  run_items(pool, max_workers, items, [=]() {
    return [=, scores = std::vector<float>(), probs = std::vector<float>()](int64_t r) mutable {
      const float* q_row[kRows];
      float* out_row[kRows];
      int64_t limit[kRows];
      const int64_t tile = tiles - 1 - r / BH, bh = r % BH, b = bh / H_kv, h = bh % H_kv;
      const int64_t i0 = tile * kRows, rows = std::min<int64_t>(kRows, T * G - i0), length = (*keys_shared)[b];
      const int64_t width = (length + 7) / 8 * 8;
      if (static_cast<int64_t>(scores.size()) < kRows * width) scores.resize(kRows * width), probs.resize(kRows * width);
      int64_t n = 0;
      for (int64_t i = 0; i < kRows; ++i) {
        const int64_t row = std::min(i0 + i, T * G - 1), t = row / G, head = h * G + row % G;
        q_row[i] = q + ((b * T + t) * H + head) * D;  // rows past the end repeat the last (not stored)
        out_row[i] = out + ((b * T + t) * H + head) * D;
        limit[i] = std::clamp<int64_t>(static_cast<int64_t>(positions[b * T + t]) + 1, 0, length);
        n = std::max(n, limit[i]);
      }
      auto tile_fn = D == 64 ? prefill_tile<64> : D == 128 ? prefill_tile<128> : prefill_tile<0>;
      tile_fn(q_row, out_row, limit, static_cast<int>(rows), n, kt.get() + (*offsets)[bh], width,
              vr.get() + (*offsets)[bh], D, scale, scores.data(), probs.data());
    };
  });
}

ffi::Error PrefillAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                                ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> positions,
                                ffi::Buffer<ffi::S32> lengths, float scale, int64_t max_threads,
                                ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), pd = positions.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || v.dimensions().size() != 4 || pd.size() != 2) {
    return ffi::Error::InvalidArgument("jkv prefill attention: expects q [B, T, H, D], k, v [B, H_kv, N, D]");
  }
  const int64_t B = qd[0], T = qd[1], H = qd[2], D = qd[3], H_kv = kd[1];
  if (kd[0] != B || kd[3] != D || v.dimensions()[2] != kd[2] || H_kv <= 0 || H % H_kv != 0 || D % 16 != 0 || D > 256 || pd[0] != B ||
      pd[1] != T) {
    return ffi::Error::InvalidArgument("jkv prefill attention: shapes disagree (B, T, D % 16 and <= 256, H % H_kv)");
  }
  const int64_t workers = std::max<int64_t>(1, max_threads > 0 ? max_threads : pool.num_threads());
  if (B * T > 0) {
    const float *k_data = k.typed_data(), *v_data = v.typed_data();
    const int64_t N = kd[2];
    attend_causal(pool, workers, q.typed_data(), positions.typed_data(), lengths.typed_data(), B, T, H, H_kv, D, N,
                  scale, out->typed_data(), [=](int64_t b, int64_t h, int64_t j) {
                    const int64_t row = ((b * H_kv + h) * N + j) * D;
                    return std::make_pair(k_data + row, v_data + row);
                  });
  }
  return ffi::Error::Success();
}

// A prefill chunk over the paged context (`models.paged.chunk_attention`'s contract):
//   q          f32[B, C, H, D]          the chunk's queries; chunk token j of row b is at position start[b] + j
//   k, v       f32[B, C, H_kv, D]       the chunk's keys and values (valid for j < lengths[b])
//   k_pages, v_pages f32[num_pages, H_kv, P, D]; table s32[B, max_pages]: position t < start[b] is
//                                       page table[b, t / P] (clipped into the pool), slot t % P
//   start, lengths s32[B]
//   out        f32[B, C, H, D]          query j sees positions <= start[b] + j that are < start[b] + lengths[b]
ffi::Error ChunkAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                              ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                              ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> start, ffi::Buffer<ffi::S32> lengths,
                              float scale, int64_t max_threads, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), pd = k_pages.dimensions(), td = table.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || v.dimensions().size() != 4 || pd.size() != 4 ||
      v_pages.dimensions().size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument(
        "jkv chunk attention: expects q [B, C, H, D], k, v [B, C, H_kv, D], pages [num_pages, H_kv, P, D]");
  }
  const int64_t B = qd[0], C = qd[1], H = qd[2], D = qd[3], H_kv = kd[2], num_pages = pd[0], P = pd[2];
  if (kd[0] != B || kd[1] != C || kd[3] != D || pd[1] != H_kv || pd[3] != D || H_kv <= 0 || H % H_kv != 0 ||
      D % 16 != 0 || D > 256 || td[0] != B || num_pages <= 0 || P <= 0) {
    return ffi::Error::InvalidArgument("jkv chunk attention: shapes disagree (B, C, D % 16 and <= 256, H % H_kv)");
  }
  const int64_t workers = std::max<int64_t>(1, max_threads > 0 ? max_threads : pool.num_threads());
  const int64_t max_pages = td[1], N = max_pages * P + C;
  std::vector<int32_t> first(B), positions(B * C), key_counts(B);
  for (int64_t b = 0; b < B; ++b) {
    first[b] = static_cast<int32_t>(std::clamp<int64_t>(start.typed_data()[b], 0, max_pages * P));
    key_counts[b] = first[b] + static_cast<int32_t>(std::clamp<int64_t>(lengths.typed_data()[b], 0, C));
    for (int64_t j = 0; j < C; ++j) positions[b * C + j] = first[b] + static_cast<int32_t>(j);
  }
  if (B * C > 0) {
    const float *kc = k.typed_data(), *vc = v.typed_data(), *kp = k_pages.typed_data(), *vp = v_pages.typed_data();
    const int32_t* tab = table.typed_data();
    attend_causal(pool, workers, q.typed_data(), positions.data(), key_counts.data(), B, C, H, H_kv, D, N, scale,
                  out->typed_data(), [&](int64_t b, int64_t h, int64_t j) {
                    if (j < first[b]) {
                      const int64_t page = std::clamp<int64_t>(tab[b * max_pages + j / P], 0, num_pages - 1);
                      const int64_t row = ((page * H_kv + h) * P + j % P) * D;
                      return std::make_pair(kp + row, vp + row);
                    }
                    const int64_t row = ((b * C + (j - first[b])) * H_kv + h) * D;
                    return std::make_pair(kc + row, vc + row);
                  });
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// Top-k selection (`pallas_kernels.topk.topk_select_reference`'s contract):
//   scores     f32[R, N]
//   valid_len  s32[R]         row r selects among its first clamp(valid_len[r], 0, N) scores
//   k          i64 attribute
//   out        s32[R, k]      indices by descending score (-0 ties +0), ties by lower index, a NaN
//                             after every number (NaNs by index); slots past min(k, valid) are -1
// Why a kernel: XLA:CPU's TopK is a std::partial_sort of every row with a comparator that
// converts both floats per comparison: at the decode worker's 12 rows of 2,176 scores and k = 544
// it took 1.25 ms a call, ~42 ms of a full-mode decode step (docs/performance.md). Here each
// candidate becomes one 64-bit key (score's order in the high half, the inverted index in the
// low half), nth_element finds the k largest in linear time and only those k are sorted.
inline int64_t topk_key(float x, int64_t index) {
  int64_t order;
  if (x != x) {
    order = std::numeric_limits<int32_t>::min();  // below -inf's order (-2139095041); key >= INT64_MIN
  } else {
    int32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    order = x == 0.0f ? 0 : bits >= 0 ? bits : bits ^ 0x7fffffff;  // monotone in x; -0 is +0
  }
  return order * (int64_t{1} << 32) + (0xffffffffLL - index);  // larger key first: lower index on ties
}

ffi::Error TopkSelectImpl(ffi::Buffer<ffi::F32> scores, ffi::Buffer<ffi::S32> valid_len, int64_t k,
                          ffi::ResultBuffer<ffi::S32> out) {
  const auto sd = scores.dimensions();
  if (sd.size() != 2 || valid_len.dimensions().size() != 1 || valid_len.dimensions()[0] != sd[0] || k < 1 ||
      out->dimensions().size() != 2 || out->dimensions()[1] != k) {
    return ffi::Error::InvalidArgument("jkv top-k: expects scores [R, N], valid_len [R], out [R, k], k >= 1");
  }
  const int64_t R = sd[0], N = sd[1];
  const float* x = scores.typed_data();
  int32_t* o = out->typed_data();
  std::vector<int64_t> keys(N);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t m = std::clamp<int64_t>(valid_len.typed_data()[r], 0, N), take = std::min(k, m);
    for (int64_t j = 0; j < m; ++j) keys[j] = topk_key(x[r * N + j], j);
    auto first = keys.begin(), cut = first + take, last = first + m;
    if (take < m) std::nth_element(first, cut, last, std::greater<int64_t>());
    std::sort(first, cut, std::greater<int64_t>());
    for (int64_t i = 0; i < take; ++i) o[r * k + i] = static_cast<int32_t>(0xffffffffLL - (keys[i] & 0xffffffffLL));
    std::fill(o + r * k + take, o + (r + 1) * k, -1);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JkvPagedDecodeAttention, PagedDecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("max_threads")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JkvPrefillAttention, PrefillAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("max_threads")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JkvChunkAttention, ChunkAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("max_threads")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JkvTopkSelect, TopkSelectImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("k")
                                  .Ret<ffi::Buffer<ffi::S32>>());
