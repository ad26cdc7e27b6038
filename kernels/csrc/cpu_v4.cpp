// DeepSeek-V4's CPU step (kernels/cpu_v4.py; the twin: dsv3lite/v4's eager sub-steps, docs/dsv4-math.md §2-4), for
// batch 1 on fp32 activations, any number of tokens a call (decode, MTP verification, prefill chunks): one block's
// attention (mHC pre, the q / kv / compressor / indexer projections, the window ring and the compressors' state,
// the indexer's top-k, attention over the window and the compressed entries with the sink, inverse RoPE, the
// grouped output projection, mHC post), one block's feed-forward (mHC pre, the sqrt-softplus router with hash or
// learned choice, the routed experts through dsv3_moe with the SwiGLU clamp, the shared expert, mHC post), and every
// main layer in one call. Compiled in one translation unit after cpu_kernels.cpp (kernels/cpu_build.py), whose
// row kernels (`linear`, `rows`), activations and thread helpers it uses. Each token's result depends only on its
// own inputs and the cache (the row dots as dsv3_linear's, every other loop per token, the entries pooled once
// from per-token values), so a token gets the same bits however many tokens share the call.
namespace {

constexpr int64_t MAX_HC = 16;                // streams the mHC holds on the stack

struct HcDesc {                               // one mHC (hc_attn / hc_ffn): fn [(2 + n) n, n D], base, scale [3]
  const float* fn;
  const float* base;
  const float* scale;
  int64_t n, iters;
  float eps, hc_eps;
};

struct V4AttnDesc {
  HcDesc hc;
  Lin wq_a, wq_b, wkv, wo_a, wo_b;
  Lin c_wkv, c_wgate;                         // the compressor (c_wkv.w null: a sliding layer)
  Lin i_wq_b, i_wproj, i_wkv, i_wgate;        // the lightning indexer (i_wq_b.w null: none)
  const float* attn_norm;
  const float* q_norm;
  const float* kv_norm;
  const float* sink;                          // [heads]
  const float* c_ape;                         // [ratio, channels]
  const float* c_norm;                        // [head_dim]
  const float* i_ape;
  const float* i_norm;                        // [index_dim]
  const float* inv_freq;                      // [rope / 2]: this layer's rotary (main, or compress)
  int64_t dim, heads, head_dim, rope, q_lora, groups, window, ratio, overlap, index_heads, index_dim, index_topk;
  float eps, unused;
};

struct V4CacheDesc {                          // one block's cache object (dsv3lite/v4/cache.py), fp32 tensors
  float* ring;                                // [ring_slots, head_dim]: position p's kv at slot p % ring_slots
  float* c_cv;                                // the compressor's (Cv, G) rings [c_slots, channels]
  float* c_g;
  float* c_entries;                           // [entry_cap, head_dim]
  float* i_cv;                                // the indexer compressor's, its keys [entry_cap, index_dim]
  float* i_g;
  float* i_entries;
  int64_t ring_slots, c_slots, i_slots, entry_cap;
};

struct V4FfnDesc {
  HcDesc hc;
  Lin w1, w3, w2;                             // the shared expert (w1.w null: none)
  Lin gate;                                   // the router [E, D]
  const float* norm;                          // ffn_norm
  const float* gate_bias;                     // [E]: a learned router; null: a hash layer
  const void* tid2eid;                        // a hash layer's table [vocab, topk], int32 or int64 (tid_bytes)
  const int64_t* expert_ptrs;                 // [E], as dsv3_moe's
  const int64_t* expert_desc;
  int64_t dim, n_experts, topk, vocab, tid_bytes, norm_topk, act;
  float eps, scaling, limit, unused;
};

thread_local std::vector<uint8_t> tl_v4_attn, tl_v4_ffn, tl_v4_hc, tl_v4_acts, tl_v4_item, tl_v4_keys;

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

inline Mat mat_of(const Lin& l) {
  Mat m;
  m.fmt = l.fmt;
  m.n = l.n;
  m.k = l.k;
  m.group = l.fmt == FP8 ? FP8_BLOCK : l.group;
  m.w = static_cast<const uint8_t*>(l.w);
  m.s = static_cast<const uint8_t*>(l.s);
  m.z = static_cast<const uint8_t*>(l.z);
  return m;
}

// ---- mHC (§2.2, §2.4) --------------------------------------------------------------------------------------
// For T tokens of streams x [T, n D]: pre [T, n], post [T, n], comb [T, n, n] (comb[i n + k]: stream i into output
// stream k; Sinkhorn, columns ~1) and the collapse u [T, D] = sum_i pre_i x_i. mix = (fn . x) * rsqrt(mean(x^2) + eps)
int hc_pre(const HcDesc& h, int64_t D, const float* x, int64_t T, float* pre, float* post, float* comb, float* u,
           int threads) {
  const int64_t n = h.n, nd = n * D, M = (2 + n) * n;
  float* mix = floats(tl_v4_hc, T * M);
  const Lin fn{F32, M, nd, 0, h.fn, nullptr, nullptr};
  if (int rc = linear(fn, x, T, mix, threads)) return rc;
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x + t * nd;
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= nd; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(xt + j), _mm256_loadu_ps(xt + j), acc);
    float ss = hsum(acc);
    for (; j < nd; ++j) ss += xt[j] * xt[j];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(nd) + h.eps);
    const float* m = mix + t * M;
    float* pr = pre + t * n;
    float* po = post + t * n;
    float* c = comb + t * n * n;
    for (int64_t i = 0; i < n; ++i) {
      pr[i] = sigmoid(m[i] * r * h.scale[0] + h.base[i]) + h.hc_eps;
      po[i] = 2.0f * sigmoid(m[n + i] * r * h.scale[1] + h.base[n + i]);
    }
    for (int64_t i = 0; i < n; ++i) {          // softmax over the last index, then + eps
      float* row = c + i * n;
      float mx = -INFINITY;
      for (int64_t k = 0; k < n; ++k)
        mx = std::max(mx, row[k] = m[2 * n + i * n + k] * r * h.scale[2] + h.base[2 * n + i * n + k]);
      float sum = 0.f;
      for (int64_t k = 0; k < n; ++k) sum += (row[k] = std::exp(row[k] - mx));
      for (int64_t k = 0; k < n; ++k) row[k] = row[k] / sum + h.hc_eps;
    }
    auto columns = [&] {
      for (int64_t k = 0; k < n; ++k) {
        float s = 0.f;
        for (int64_t i = 0; i < n; ++i) s += c[i * n + k];
        for (int64_t i = 0; i < n; ++i) c[i * n + k] /= s + h.hc_eps;
      }
    };
    columns();                                 // a column step first, then (row, column) iters - 1 times
    for (int64_t it = 1; it < h.iters; ++it) {
      for (int64_t i = 0; i < n; ++i) {
        float s = 0.f;
        for (int64_t k = 0; k < n; ++k) s += c[i * n + k];
        for (int64_t k = 0; k < n; ++k) c[i * n + k] /= s + h.hc_eps;
      }
      columns();
    }
    float* ut = u + t * D;
    for (int64_t d = 0; d < D; ++d) ut[d] = pr[0] * xt[d];
    for (int64_t i = 1; i < n; ++i)
      for (int64_t d = 0; d < D; ++d) ut[d] = ut[d] + pr[i] * xt[i * D + d];
  }
  return 0;
}

// out[t, k] = post[t, k] f[t] + sum_i comb[t, i, k] x[t, i] (out may not alias x)
void hc_post(int64_t n, int64_t D, const float* x, const float* f, const float* post, const float* comb, int64_t T,
             float* out) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x + t * n * D;
    const float* c = comb + t * n * n;
    for (int64_t k = 0; k < n; ++k) {
      float* o = out + (t * n + k) * D;
      const float pk = post[t * n + k];
      for (int64_t d = 0; d < D; ++d) o[d] = c[k] * xt[d];
      for (int64_t i = 1; i < n; ++i)
        for (int64_t d = 0; d < D; ++d) o[d] = o[d] + c[i * n + k] * xt[i * D + d];
      for (int64_t d = 0; d < D; ++d) o[d] = pk * f[t * D + d] + o[d];
    }
  }
}

// ---- RoPE (§3): the last `rope` dims as interleaved pairs ---------------------------------------------------
void rope_table(const float* inv_freq, int64_t half, int64_t p, float* cs, float* sn) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = static_cast<float>(p) * inv_freq[i];
    cs[i] = std::cos(a);
    sn[i] = std::sin(a);
  }
}

// rotate v [width]'s last 2 * half dims by the table (sign -1: undo the rotation)
void rope_apply(float* v, int64_t width, int64_t half, const float* cs, const float* sn, float sign) {
  float* r = v + width - 2 * half;
  for (int64_t i = 0; i < half; ++i) {
    const float e = r[2 * i], o = r[2 * i + 1], s = sign * sn[i];
    r[2 * i] = e * cs[i] - o * s;
    r[2 * i + 1] = o * cs[i] + e * s;
  }
}

// per-head RMSNorm without weight: v * rsqrt(mean(v^2) + eps)
void unit_rms(float* v, int64_t n, float eps) {
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(v + j), _mm256_loadu_ps(v + j), acc);
  float ss = hsum(acc);
  for (; j < n; ++j) ss += v[j] * v[j];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (j = 0; j < n; ++j) v[j] = v[j] * r;
}

// ---- compressors (§2.3, §4.2) -----------------------------------------------------------------------------------
struct Compressor {                            // one compressor's weights and state
  const Lin* wkv;
  const Lin* wgate;
  const float* ape;                            // [ratio, channels]
  const float* norm;                           // [width]
  float* cv;                                   // rings [slots, channels]
  float* g;
  float* entries;                              // [cap, width]
  int64_t ratio, overlap, width, slots;
};

// entry w from the rings (its window's tokens, and with overlap the previous window's): per channel a softmax of the
// gates over the slots weights the values; then norm and RoPE at position w * ratio
void pool_entry(const Compressor& c, int64_t w, const float* inv_freq, int64_t half, float eps) {
  const int64_t m = c.ratio, width = c.width, ch = width * (1 + c.overlap), n_slots = m * (1 + c.overlap);
  float* buf = floats(tl_v4_item, n_slots * width + 3 * width + 2 * half);
  float* e = buf;                              // [n_slots, width] exp(g - max), then the weights
  float* mx = e + n_slots * width;
  float* pooled = mx + width;
  float* out = pooled + width;
  float* cs = out + width;
  float* sn = cs + half;
  // slot j: (token, channel offset); with overlap slots 0..m-1 are window w-1's series A (none before position 0)
  auto token_of = [&](int64_t j, int64_t& tok, int64_t& off) {
    if (c.overlap && j < m) {
      tok = (w - 1) * m + j;
      off = 0;
    } else {
      tok = w * m + (c.overlap ? j - m : j);
      off = c.overlap ? width : 0;
    }
  };
  std::fill(mx, mx + width, -INFINITY);
  for (int64_t j = 0; j < n_slots; ++j) {
    int64_t tok, off;
    token_of(j, tok, off);
    float* ej = e + j * width;
    if (tok < 0) {
      std::fill(ej, ej + width, -INFINITY);
      continue;
    }
    const float* g = c.g + (tok % c.slots) * ch + off;
    for (int64_t i = 0; i < width; ++i) mx[i] = std::max(mx[i], ej[i] = g[i]);
  }
  std::fill(pooled, pooled + width, 0.f);
  std::fill(out, out + width, 0.f);            // out: the softmax denominators first
  for (int64_t j = 0; j < n_slots; ++j) {
    float* ej = e + j * width;
    for (int64_t i = 0; i < width; ++i) out[i] += (ej[i] = std::exp(ej[i] - mx[i]));
  }
  for (int64_t j = 0; j < n_slots; ++j) {
    int64_t tok, off;
    token_of(j, tok, off);
    if (tok < 0) continue;                     // weight 0, value 0
    const float* v = c.cv + (tok % c.slots) * ch + off;
    const float* ej = e + j * width;
    for (int64_t i = 0; i < width; ++i) pooled[i] = pooled[i] + v[i] * (ej[i] / out[i]);
  }
  float* entry = c.entries + w * width;
  rmsnorm(pooled, c.norm, width, eps, entry);
  rope_table(inv_freq, half, w * m, cs, sn);
  rope_apply(entry, width, half, cs, sn, 1.0f);
}

// the compressor over T tokens of a [T, D] at positions start..: each token's (Cv, G = Cz + ape[p mod m]) into the
// rings, in order, and each window it completes pooled into its entry
int compress(const Compressor& c, const float* a, int64_t T, int64_t start, const float* inv_freq, int64_t half,
             float eps, float* scratch_cv, float* scratch_g, int threads) {
  const int64_t ch = c.wkv->n;
  int rc;
  if ((rc = linear(*c.wkv, a, T, scratch_cv, threads)) || (rc = linear(*c.wgate, a, T, scratch_g, threads))) return rc;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t p = start + t, slot = p % c.slots;
    std::memcpy(c.cv + slot * ch, scratch_cv + t * ch, ch * sizeof(float));
    const float* ape = c.ape + (p % c.ratio) * ch;
    float* g = c.g + slot * ch;
    for (int64_t i = 0; i < ch; ++i) g[i] = scratch_g[t * ch + i] + ape[i];
    if ((p + 1) % c.ratio == 0) pool_entry(c, p / c.ratio, inv_freq, half, eps);
  }
  return 0;
}

// ---- the lightning indexer (§2.3): the entries a query at p keeps, ascending -----------------------------------
// qi [index_heads, index_dim] (RoPE applied), wi [index_heads] (times index_heads^-0.5), keys [n_visible, index_dim]
// -> score_w = sum_h wi_h * relu(qi_h . K_w) * index_dim^-0.5; the top `topk` (ties: the lower id), sorted ascending
void index_select(const V4AttnDesc& d, const float* qi, const float* wi, const float* keys, int64_t n_visible,
                  float* score, int64_t* order, int64_t* picked, int threads) {
  const int64_t H = d.index_heads, dI = d.index_dim;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dI)));
  constexpr int64_t BLOCK = 64;
  const int nthreads = thread_count(threads, n_visible * dI * 4 * 8);
  parallel_items((n_visible + BLOCK - 1) / BLOCK, nthreads, [&](int64_t item) {
    const int64_t w1 = std::min(n_visible, (item + 1) * BLOCK);
    for (int64_t w = item * BLOCK; w < w1; ++w) {
      float s = 0.f;
      for (int64_t h = 0; h < H; ++h) s += std::max(dot(qi + h * dI, keys + w * dI, dI), 0.f) * scale * wi[h];
      score[w] = s;
    }
  });
  for (int64_t w = 0; w < n_visible; ++w) order[w] = w;
  const int64_t k = d.index_topk;
  auto better = [&](int64_t a, int64_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); };
  std::nth_element(order, order + k - 1, order + n_visible, better);
  std::copy(order, order + k, picked);
  std::sort(picked, picked + k);
}

// ---- attention over keys = values (§2.3) -----------------------------------------------------------------------
constexpr int64_t HEAD_BLOCK = 4;              // heads per work item: each key is read once for them

// heads [h0, h1) of one query token over the keys (pointers to head_dim-wide rows): softmax with the sink, o = P K
void attend(const float* q, const float* sink, const float* const* keys, int64_t nk, int64_t hd, float scale,
            int64_t h0, int64_t h1, float* o) {
  const int64_t nh = h1 - h0;
  float* s = floats(tl_v4_item, HEAD_BLOCK * nk);
  for (int64_t j = 0; j < nk; ++j)
    for (int64_t h = 0; h < nh; ++h) s[h * nk + j] = dot(q + (h0 + h) * hd, keys[j], hd) * scale;
  for (int64_t h = 0; h < nh; ++h) {
    float* sh = s + h * nk;
    const float sk = sink[h0 + h];
    float mx = sk;
    for (int64_t j = 0; j < nk; ++j) mx = std::max(mx, sh[j]);
    float sum = 0.f;
    for (int64_t j = 0; j < nk; ++j) sum += (sh[j] = std::exp(sh[j] - mx));
    sum += std::exp(sk - mx);
    for (int64_t j = 0; j < nk; ++j) sh[j] /= sum;
    std::fill(o + (h0 + h) * hd, o + (h0 + h + 1) * hd, 0.f);
  }
  for (int64_t j = 0; j < nk; ++j)
    for (int64_t h = 0; h < nh; ++h) axpy(s[h * nk + j], keys[j], o + (h0 + h) * hd, hd);
}

// the grouped low-rank output projection: y [T, G R] with y[t, g R + r] = wo_a row g R + r . x[t, g in: (g + 1) in]
int grouped_linear(const Lin& l, int64_t groups, const float* x, int64_t T, float* y, int threads) {
  const Mat m = mat_of(l);
  if (m.groups() > MAX_GROUPS) return -2;
  const int64_t R = l.n / groups, in = l.k;
  const ActSize sz = act_size(m.fmt, in, m.group);
  uint8_t* abuf = scratch(tl_v4_acts, T * groups * sz.bytes());
  const int nthreads = thread_count(threads, m.row_bytes() * l.n * std::max<int64_t>(1, T / 4));
  parallel_items(T * groups, T * groups * in >= 65536 ? nthreads : 1,
                 [&](int64_t i) { prepare(x + i * in, sz, abuf + i * sz.bytes()); });
  const int64_t RB = linear_item_rows(m, R, std::max(1, nthreads / static_cast<int>(groups)));
  const int64_t per_group = (R + RB - 1) / RB;
  parallel_items(groups * per_group, nthreads, [&](int64_t item) {
    const int64_t g = item / per_group, r0 = g * R + item % per_group * RB, r1 = std::min(r0 + RB, (g + 1) * R);
    float out[MAX_TOK * MAX_RB];
    for (int64_t t0 = 0; t0 < T; t0 += MAX_TOK) {
      const int nt = static_cast<int>(std::min<int64_t>(MAX_TOK, T - t0));
      Act a[MAX_TOK];
      for (int i = 0; i < nt; ++i) a[i] = act_view(abuf + ((t0 + i) * groups + g) * sz.bytes(), sz);
      rows(m, r0, r1, a, nt, out, RB);
      for (int i = 0; i < nt; ++i) std::memcpy(y + (t0 + i) * l.n + r0, out + i * RB, (r1 - r0) * sizeof(float));
    }
  });
  return 0;
}

bool attn_fits(const V4AttnDesc& d) {
  const bool comp = d.c_wkv.w != nullptr, idx = d.i_wq_b.w != nullptr;
  return d.hc.n >= 1 && d.hc.n <= MAX_HC && d.rope % 2 == 0 && d.rope <= MAX_ROPE && d.rope <= d.head_dim &&
         d.groups >= 1 && d.heads % d.groups == 0 && d.wo_a.n % d.groups == 0 &&
         d.wo_a.k * d.groups == d.heads * d.head_dim && (!comp || d.ratio >= 1) && (!idx || comp) &&
         (!idx || (d.rope <= d.index_dim && d.index_topk >= 1));
}

// Block.attention for T tokens at positions start..: out [T, n, D] = mHC_attn(x) around attention(attn_norm(u))
int v4_attention(const V4AttnDesc& d, const V4CacheDesc& c, const float* x, float* out, int64_t T, int64_t start,
                 int threads) {
  if (!attn_fits(d)) return -3;
  const bool comp = d.c_wkv.w != nullptr, idx = d.i_wq_b.w != nullptr;
  if (comp && (start + T) / d.ratio > c.entry_cap) return -5;
  const int64_t n = d.hc.n, D = d.dim, H = d.heads, hd = d.head_dim, ql = d.q_lora, half = d.rope / 2;
  const int64_t R = d.wo_a.n, ch = comp ? d.c_wkv.n : 0, ich = idx ? d.i_wkv.n : 0;
  const int64_t HI = d.index_heads, dI = d.index_dim;
  const int64_t sizes[] = {T * n, T * n, T * n * n, T * D, T * D, T * ql, T * H * hd, T * hd, T * H * hd, T * R,
                           T * D, 2 * T * std::max(ch, ich), T * HI * dI, T * HI, T * half, T * half};
  int64_t total = 0;
  for (int64_t s : sizes) total += s;
  float* buf = floats(tl_v4_attn, total);
  float* part[16];
  for (int i = 0; i < 16; ++i) {
    part[i] = buf;
    buf += sizes[i];
  }
  float *pre = part[0], *post = part[1], *comb = part[2], *u = part[3], *a = part[4], *qa = part[5], *q = part[6];
  float *kv = part[7], *o = part[8], *y1 = part[9], *f = part[10], *cvg = part[11], *qi = part[12], *wi = part[13];
  float *cs = part[14], *sn = part[15];
  int rc;
  if ((rc = hc_pre(d.hc, D, x, T, pre, post, comb, u, threads))) return rc;
  for (int64_t t = 0; t < T; ++t) {
    rmsnorm(u + t * D, d.attn_norm, D, d.eps, a + t * D);
    rope_table(d.inv_freq, half, start + t, cs + t * half, sn + t * half);
  }
  if ((rc = linear(d.wq_a, a, T, qa, threads))) return rc;
  for (int64_t t = 0; t < T; ++t) rmsnorm(qa + t * ql, d.q_norm, ql, d.eps, qa + t * ql);
  if ((rc = linear(d.wq_b, qa, T, q, threads)) || (rc = linear(d.wkv, a, T, kv, threads))) return rc;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      float* qh = q + (t * H + h) * hd;
      unit_rms(qh, hd, d.eps);
      rope_apply(qh, hd, half, cs + t * half, sn + t * half, 1.0f);
    }
    rmsnorm(kv + t * hd, d.kv_norm, hd, d.eps, kv + t * hd);
    rope_apply(kv + t * hd, hd, half, cs + t * half, sn + t * half, 1.0f);
  }
  if (comp) {
    const Compressor main{&d.c_wkv, &d.c_wgate, d.c_ape, d.c_norm, c.c_cv, c.c_g, c.c_entries, d.ratio, d.overlap,
                          hd, c.c_slots};
    if ((rc = compress(main, a, T, start, d.inv_freq, half, d.eps, cvg, cvg + T * ch, threads))) return rc;
  }
  if (idx) {
    const Compressor keys{&d.i_wkv, &d.i_wgate, d.i_ape, d.i_norm, c.i_cv, c.i_g, c.i_entries, d.ratio, 1, dI,
                          c.i_slots};
    if ((rc = compress(keys, a, T, start, d.inv_freq, half, d.eps, cvg, cvg + T * ich, threads))) return rc;
    if ((rc = linear(d.i_wq_b, qa, T, qi, threads)) || (rc = linear(d.i_wproj, a, T, wi, threads))) return rc;
    const float wscale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(HI)));
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < HI; ++h) rope_apply(qi + (t * HI + h) * dI, dI, half, cs + t * half, sn + t * half, 1.0f);
      for (int64_t h = 0; h < HI; ++h) wi[t * HI + h] *= wscale;
    }
  }
  // each token's keys: its window (new rows from kv, older ones from the ring), then its compressed entries (all
  // visible ones, or the indexer's picks)
  const int64_t W = d.window;
  const int64_t most = comp ? (start + T) / d.ratio : 0;
  const int64_t picks = idx ? std::min(d.index_topk, most) : 0;
  int64_t* nkeys = reinterpret_cast<int64_t*>(scratch(tl_v4_keys, T * 8 + T * (W + most) * 8 + T * picks * 8 +
                                                                   (most * 12 + 64)));
  const float** keys = reinterpret_cast<const float**>(nkeys + T);
  int64_t* picked = reinterpret_cast<int64_t*>(keys + T * (W + most));
  int64_t* order = picked + T * picks;
  float* score = reinterpret_cast<float*>(order + most);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t p = start + t;
    const float** kt = keys + t * (W + most);
    int64_t nk = 0;
    for (int64_t j = std::max<int64_t>(0, p - W + 1); j <= p; ++j)
      kt[nk++] = j >= start ? kv + (j - start) * hd : c.ring + (j % c.ring_slots) * hd;
    const int64_t visible = comp ? (p + 1) / d.ratio : 0;
    if (idx && visible > d.index_topk) {
      int64_t* pk = picked + t * picks;
      index_select(d, qi + t * HI * dI, wi + t * HI, c.i_entries, visible, score, order, pk, threads);
      for (int64_t i = 0; i < d.index_topk; ++i) kt[nk++] = c.c_entries + pk[i] * hd;
    } else {
      for (int64_t w = 0; w < visible; ++w) kt[nk++] = c.c_entries + w * hd;
    }
    nkeys[t] = nk;
  }
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  const int64_t hblocks = (H + HEAD_BLOCK - 1) / HEAD_BLOCK;
  int64_t work = 0;
  for (int64_t t = 0; t < T; ++t) work += nkeys[t] * H * hd * 8;
  parallel_items(T * hblocks, thread_count(threads, work), [&](int64_t item) {
    const int64_t t = item / hblocks, h0 = item % hblocks * HEAD_BLOCK, h1 = std::min(h0 + HEAD_BLOCK, H);
    float* ot = o + t * H * hd;
    attend(q + t * H * hd, d.sink, keys + t * (W + most), nkeys[t], hd, scale, h0, h1, ot);
    for (int64_t h = h0; h < h1; ++h) rope_apply(ot + h * hd, hd, half, cs + t * half, sn + t * half, -1.0f);
  });
  if ((rc = grouped_linear(d.wo_a, d.groups, o, T, y1, threads)) || (rc = linear(d.wo_b, y1, T, f, threads)))
    return rc;
  for (int64_t t = std::max<int64_t>(0, T - c.ring_slots); t < T; ++t)
    std::memcpy(c.ring + ((start + t) % c.ring_slots) * hd, kv + t * hd, hd * sizeof(float));
  hc_post(n, D, x, f, post, comb, T, out);
  return 0;
}

// ---- the feed-forward (§2.5) ---------------------------------------------------------------------------------
bool ffn_fits(const V4FfnDesc& d) {
  return d.hc.n >= 1 && d.hc.n <= MAX_HC && d.topk >= 1 && d.topk <= d.n_experts && d.gate.n == d.n_experts &&
         (d.gate_bias != nullptr || (d.tid2eid != nullptr && (d.tid_bytes == 4 || d.tid_bytes == 8)));
}

// Block.feed_forward for T tokens: out [T, n, D] = mHC_ffn(x) around moe(ffn_norm(u)); ids [T, K] / scores [T, E]
// receive the routing; tokens [T] the ids of the positions (hash layers)
int v4_ffn(const V4FfnDesc& d, const float* x, float* out, int64_t T, const int64_t* tokens, int64_t* ids,
           float* scores, int threads) {
  if (!ffn_fits(d)) return -3;
  const int64_t n = d.hc.n, D = d.dim, E = d.n_experts, K = d.topk, I = d.w1.w ? d.w1.n : 0;
  float* buf = floats(tl_v4_ffn, T * (2 * n + n * n + 4 * D + 2 * I + E + K));
  float *pre = buf, *post = pre + T * n, *comb = post + T * n, *u = comb + T * n * n, *fx = u + T * D;
  float *routed = fx + T * D, *shared = routed + T * D, *g = shared + T * D, *up = g + T * I, *choice = up + T * I;
  float* w = choice + T * E;
  int rc;
  if ((rc = hc_pre(d.hc, D, x, T, pre, post, comb, u, threads))) return rc;
  for (int64_t t = 0; t < T; ++t) rmsnorm(u + t * D, d.norm, D, d.eps, fx + t * D);
  if ((rc = linear(d.gate, fx, T, scores, threads))) return rc;
  for (int64_t t = 0; t < T; ++t) {
    float* s = scores + t * E;
    for (int64_t e = 0; e < E; ++e) s[e] = std::sqrt(s[e] > 20.f ? s[e] : std::log1p(std::exp(s[e])));
    int64_t* it = ids + t * K;
    if (d.gate_bias) {
      float* c = choice + t * E;
      for (int64_t e = 0; e < E; ++e) c[e] = s[e] + d.gate_bias[e];
      top_k(c, E, K, it);
    } else {
      if (tokens[t] < 0 || tokens[t] >= d.vocab) return -4;
      for (int64_t k = 0; k < K; ++k)
        it[k] = d.tid_bytes == 4 ? static_cast<const int32_t*>(d.tid2eid)[tokens[t] * K + k]
                                 : static_cast<const int64_t*>(d.tid2eid)[tokens[t] * K + k];
    }
    float* wt = w + t * K;
    float sum = 0.f;
    for (int64_t k = 0; k < K; ++k) {
      if (it[k] < 0 || it[k] >= E) return -1;
      sum += (wt[k] = s[it[k]]);
    }
    for (int64_t k = 0; k < K; ++k) wt[k] = (d.norm_topk ? wt[k] / (sum + 1e-20f) : wt[k]) * d.scaling;
  }
  if ((rc = dsv3_moe(fx, T, ids, w, K, d.expert_ptrs, E, d.expert_desc, routed, 0, threads, d.limit, d.act)))
    return rc;
  if (I) {
    if ((rc = linear(d.w1, fx, T, g, threads)) || (rc = linear(d.w3, fx, T, up, threads))) return rc;
    for (int64_t j = 0; j < T * I; ++j)
      g[j] = silu(std::min(g[j], d.limit)) * std::min(std::max(up[j], -d.limit), d.limit);
    if ((rc = linear(d.w2, g, T, shared, threads))) return rc;
    for (int64_t j = 0; j < T * D; ++j) routed[j] = routed[j] + shared[j];
  }
  hc_post(n, D, x, routed, post, comb, T, out);
  return 0;
}

}  // namespace

extern "C" {

// The V4 descriptors' layouts (kernels/cpu_abi.py compares them with its ctypes structs); as dsv3_struct_layout.
int64_t dsv4_struct_layout(const char* name, int64_t* out, int64_t cap) {
#define DSV4_AT(S, f) static_cast<int64_t>(offsetof(S, f))
  std::vector<int64_t> v;
  if (std::strcmp(name, "HcDesc") == 0) {
    v = {sizeof(HcDesc), DSV4_AT(HcDesc, fn), DSV4_AT(HcDesc, base), DSV4_AT(HcDesc, scale), DSV4_AT(HcDesc, n),
         DSV4_AT(HcDesc, iters), DSV4_AT(HcDesc, eps), DSV4_AT(HcDesc, hc_eps)};
  } else if (std::strcmp(name, "V4AttnDesc") == 0) {
    v = {sizeof(V4AttnDesc), DSV4_AT(V4AttnDesc, hc), DSV4_AT(V4AttnDesc, wq_a), DSV4_AT(V4AttnDesc, wq_b),
         DSV4_AT(V4AttnDesc, wkv), DSV4_AT(V4AttnDesc, wo_a), DSV4_AT(V4AttnDesc, wo_b), DSV4_AT(V4AttnDesc, c_wkv),
         DSV4_AT(V4AttnDesc, c_wgate), DSV4_AT(V4AttnDesc, i_wq_b), DSV4_AT(V4AttnDesc, i_wproj),
         DSV4_AT(V4AttnDesc, i_wkv), DSV4_AT(V4AttnDesc, i_wgate), DSV4_AT(V4AttnDesc, attn_norm),
         DSV4_AT(V4AttnDesc, q_norm), DSV4_AT(V4AttnDesc, kv_norm), DSV4_AT(V4AttnDesc, sink),
         DSV4_AT(V4AttnDesc, c_ape), DSV4_AT(V4AttnDesc, c_norm), DSV4_AT(V4AttnDesc, i_ape),
         DSV4_AT(V4AttnDesc, i_norm), DSV4_AT(V4AttnDesc, inv_freq), DSV4_AT(V4AttnDesc, dim),
         DSV4_AT(V4AttnDesc, heads), DSV4_AT(V4AttnDesc, head_dim), DSV4_AT(V4AttnDesc, rope),
         DSV4_AT(V4AttnDesc, q_lora), DSV4_AT(V4AttnDesc, groups), DSV4_AT(V4AttnDesc, window),
         DSV4_AT(V4AttnDesc, ratio), DSV4_AT(V4AttnDesc, overlap), DSV4_AT(V4AttnDesc, index_heads),
         DSV4_AT(V4AttnDesc, index_dim), DSV4_AT(V4AttnDesc, index_topk), DSV4_AT(V4AttnDesc, eps),
         DSV4_AT(V4AttnDesc, unused)};
  } else if (std::strcmp(name, "V4CacheDesc") == 0) {
    v = {sizeof(V4CacheDesc), DSV4_AT(V4CacheDesc, ring), DSV4_AT(V4CacheDesc, c_cv), DSV4_AT(V4CacheDesc, c_g),
         DSV4_AT(V4CacheDesc, c_entries), DSV4_AT(V4CacheDesc, i_cv), DSV4_AT(V4CacheDesc, i_g),
         DSV4_AT(V4CacheDesc, i_entries), DSV4_AT(V4CacheDesc, ring_slots), DSV4_AT(V4CacheDesc, c_slots),
         DSV4_AT(V4CacheDesc, i_slots), DSV4_AT(V4CacheDesc, entry_cap)};
  } else if (std::strcmp(name, "V4FfnDesc") == 0) {
    v = {sizeof(V4FfnDesc), DSV4_AT(V4FfnDesc, hc), DSV4_AT(V4FfnDesc, w1), DSV4_AT(V4FfnDesc, w3),
         DSV4_AT(V4FfnDesc, w2), DSV4_AT(V4FfnDesc, gate), DSV4_AT(V4FfnDesc, norm), DSV4_AT(V4FfnDesc, gate_bias),
         DSV4_AT(V4FfnDesc, tid2eid), DSV4_AT(V4FfnDesc, expert_ptrs), DSV4_AT(V4FfnDesc, expert_desc),
         DSV4_AT(V4FfnDesc, dim), DSV4_AT(V4FfnDesc, n_experts), DSV4_AT(V4FfnDesc, topk), DSV4_AT(V4FfnDesc, vocab),
         DSV4_AT(V4FfnDesc, tid_bytes), DSV4_AT(V4FfnDesc, norm_topk), DSV4_AT(V4FfnDesc, act),
         DSV4_AT(V4FfnDesc, eps), DSV4_AT(V4FfnDesc, scaling), DSV4_AT(V4FfnDesc, limit), DSV4_AT(V4FfnDesc, unused)};
  }
#undef DSV4_AT
  if (v.empty() || static_cast<int64_t>(v.size()) > cap) return -1;
  std::copy(v.begin(), v.end(), out);
  return static_cast<int64_t>(v.size());
}

// The mHC pre of T tokens of streams x [T, n, dim]: pre [T, n], post [T, n], comb [T, n, n], u [T, dim].
int dsv4_hc_pre(const HcDesc* h, int64_t dim, const float* x, int64_t T, float* pre, float* post, float* comb,
                float* u, int threads) {
  if (h->n < 1 || h->n > MAX_HC) return -3;
  return hc_pre(*h, dim, x, T, pre, post, comb, u, threads);
}

// Block.attention for T tokens at positions start.. (batch 1) over streams x [T, n, dim] -> out [T, n, dim]; the
// cache's ring, compressor states and entries get the tokens' rows (the caller has set its length).
// Returns 0, -2 (a weight with too many groups), -3 (a descriptor past the kernel's bounds), -5 (no room for an entry).
int dsv4_attention(const V4AttnDesc* d, const V4CacheDesc* c, const float* x, float* out, int64_t T, int64_t start,
                   int threads) {
  return v4_attention(*d, *c, x, out, T, start, threads);
}

// Block.feed_forward for T tokens: x [T, n, dim] -> out [T, n, dim]; tokens [T] (hash layers); ids [T, topk] and
// scores [T, n_experts] receive the routing. Returns 0, -1 (an expert id out of range), -3, -4 (a token id out of
// the hash table).
int dsv4_ffn(const V4FfnDesc* d, const float* x, float* out, int64_t T, const int64_t* tokens, int64_t* ids,
             float* scores, int threads) {
  return v4_ffn(*d, x, out, T, tokens, ids, scores, threads);
}

// Every main layer of a step in order in one call: layer i's attention (from x for the first, else from out) into
// tmp, then its feed-forward from tmp into out; caches[i] is layer i's cache, ids[i] / scores[i] its routing.
int dsv4_layers(int64_t n, const V4AttnDesc* const* attn, const V4FfnDesc* const* ffn, const V4CacheDesc* const* caches,
                const float* x, float* tmp, float* out, int64_t T, int64_t start, const int64_t* tokens,
                int64_t* const* ids, float* const* scores, int threads) {
  for (int64_t i = 0; i < n; ++i) {
    int rc = v4_attention(*attn[i], *caches[i], i == 0 ? x : out, tmp, T, start, threads);
    if (rc || (rc = v4_ffn(*ffn[i], tmp, out, T, tokens, ids[i], scores[i], threads))) return rc;
  }
  return 0;
}

}  // extern "C"
