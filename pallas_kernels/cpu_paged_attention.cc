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
#include <cstdint>
#include <cstring>
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

template <typename T>
void attend(ffi::ThreadPool& pool, int64_t max_workers, const float* q, const T* k_pages, const T* v_pages,
            const int32_t* table, const int32_t* lengths, int64_t B, int64_t H, int64_t D, int64_t num_pages,
            int64_t H_kv, int64_t P, int64_t max_pages, float scale, float* out, float* lse) {
  const int64_t G = H / H_kv, capacity = max_pages * P, page_stride = H_kv * P * D, rows = B * H_kv;
  auto queue = std::make_shared<RowQueue>();
  auto work = [=]() {
    std::vector<float> logits, row;
    for (int64_t r; (r = queue->next.fetch_add(1)) < rows;) {
      if (logits.empty()) logits.resize(G * capacity), row.resize(P * D);
      const int64_t b = r / H_kv, h = r % H_kv, first = b * H + h * G;  // query heads h*G .. h*G+G-1 of row b
      const int64_t n = std::clamp<int64_t>(lengths[b], 0, capacity);
      auto row_fn = D == 64 ? attend_row<64, T> : D == 128 ? attend_row<128, T> : attend_row<0, T>;
      row_fn(q + first * D, k_pages, v_pages, table + b * max_pages, n, num_pages, page_stride, h * P * D, P, D, G,
             scale, logits.data(), row.data(), out + first * D, lse + first);
      if (queue->done.fetch_add(1) + 1 == rows) {
        std::lock_guard<std::mutex> lock(queue->mutex);
        queue->finished.notify_all();
      }
    }
  };
  // A task pays a wake-up (~10 us); split only rows worth several of those (~16K key-head reads).
  int64_t tokens = 0;
  for (int64_t b = 0; b < B; ++b) tokens += std::clamp<int64_t>(lengths[b], 0, capacity) * H_kv;
  const int64_t workers = std::min({max_workers, rows, 1 + tokens / 16384});
  for (int64_t i = 1; i < workers; ++i) pool.Schedule(decltype(work)(work));  // a copy per task
  work();
  std::unique_lock<std::mutex> lock(queue->mutex);
  queue->finished.wait(lock, [&] { return queue->done.load() == rows; });
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
