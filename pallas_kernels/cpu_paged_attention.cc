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
// exp(logit - lse) times V), so results differ from it only by float summation order and the exp /
// log implementations (~1e-7 relative). Slots past a row's length are never read, as the reference
// masks them (garbage or NaN there does not leak).
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

inline float load(float x) { return x; }
inline float load(uint16_t bf16) {  // bfloat16 is the high half of a float32
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// One (request, KV head) row: G query heads over n tokens. q, out: [G, D]; lse: [G].
template <typename T>
void attend_row(const float* q, const T* k_pages, const T* v_pages, const int32_t* table, int64_t n,
                int64_t num_pages, int64_t page_stride, int64_t head_offset, int64_t P, int64_t D,
                int64_t G, float scale, float* logits /* [G, n] */, float* row /* [D] */, float* out,
                float* lse) {
  std::fill(out, out + G * D, 0.0f);
  if (n <= 0) {
    std::fill(lse, lse + G, -std::numeric_limits<float>::infinity());
    return;
  }
  std::vector<float> maxima(G, -std::numeric_limits<float>::infinity());
  const int64_t pages = (n + P - 1) / P;
  for (int64_t j = 0; j < pages; ++j) {
    const int64_t page = std::clamp<int64_t>(table[j], 0, num_pages - 1);
    const T* block = k_pages + page * page_stride + head_offset;  // [P, D], contiguous
    const int64_t slots = std::min<int64_t>(P, n - j * P);
    for (int64_t t = 0; t < slots; ++t) {
      const T* key = block + t * D;
      for (int64_t d = 0; d < D; ++d) row[d] = load(key[d]);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * D;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += qg[d] * row[d];
        s *= scale;
        logits[g * n + j * P + t] = s;
        maxima[g] = std::max(maxima[g], s);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {  // lse = max + log(sum exp(l - max)), as jax.nn.logsumexp
    float* l = logits + g * n;
    const float m = std::isfinite(maxima[g]) ? maxima[g] : 0.0f;
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) sum += std::exp(l[i] - m);
    lse[g] = std::log(sum) + m;
    const float shift = std::isfinite(lse[g]) ? lse[g] : 0.0f;
    for (int64_t i = 0; i < n; ++i) l[i] = std::exp(l[i] - shift);  // probabilities
  }
  for (int64_t j = 0; j < pages; ++j) {
    const int64_t page = std::clamp<int64_t>(table[j], 0, num_pages - 1);
    const T* block = v_pages + page * page_stride + head_offset;
    const int64_t slots = std::min<int64_t>(P, n - j * P);
    for (int64_t t = 0; t < slots; ++t) {
      const T* value = block + t * D;
      for (int64_t d = 0; d < D; ++d) row[d] = load(value[d]);
      for (int64_t g = 0; g < G; ++g) {
        const float p = logits[g * n + j * P + t];
        float* o = out + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] += p * row[d];
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
      if (logits.empty()) logits.resize(G * capacity), row.resize(D);
      const int64_t b = r / H_kv, h = r % H_kv, first = b * H + h * G;  // query heads h*G .. h*G+G-1 of row b
      const int64_t n = std::clamp<int64_t>(lengths[b], 0, capacity);
      attend_row(q + first * D, k_pages, v_pages, table + b * max_pages, n, num_pages, page_stride, h * P * D, P,
                 D, G, scale, logits.data(), row.data(), out + first * D, lse + first);
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
