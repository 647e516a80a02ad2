/* grain_elevator.server._riegeli: the hot part of reading ArrayRecord shards.
 *
 * ArrayRecord files are riegeli files: chunks interrupted every 64 KiB by a
 * 24-byte block header, each chunk a 40-byte header and its data, both
 * protected by a 64-bit HighwayHash with a fixed key
 * (riegeli/doc/riegeli_records_file_format.md). ArrayRecord's reader spends
 * ~20 µs of CPU per small record through its Python binding and thread pool;
 * this reads a chunk with one pread, checks both hashes and returns the data,
 * with the GIL released around the I/O and the hashing. Decompression and the
 * simple-chunk framing stay in Python (server/data/shards/reader.py).
 *
 * HighwayHash is implemented here from its published description (portable
 * lanes, and AVX2 where the CPU has it, chosen at import); the tests check it
 * against the hashes riegeli itself wrote.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <limits.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_X86 1
#endif

#define BLOCK_SIZE 65536u
#define BLOCK_HEADER_SIZE 24u
#define CHUNK_HEADER_SIZE 40u
/* Chunks whose whole extent fits in this are read with one pread into a
 * scratch buffer; bigger ones read their data straight into the result. */
#define SMALL_EXTENT (64u << 10)
#define RELEASE_GIL_BYTES 16384u

/* ------------------------------------------------------------------------ */
/* HighwayHash-64                                                            */

static const uint64_t kInitMul0[4] = {0xdbe6d5d5fe4cce2full, 0xa4093822299f31d0ull,
                                      0x13198a2e03707344ull, 0x243f6a8885a308d3ull};
static const uint64_t kInitMul1[4] = {0x3bd39e10cb0ef593ull, 0xc0acf169b5f18a8cull,
                                      0xbe5466cf34e90c6cull, 0x452821e638d01377ull};
/* 'Riegeli/', 'records\n', twice. */
static const uint64_t kRiegeliKey[4] = {0x2f696c6567656952ull, 0x0a7364726f636572ull,
                                        0x2f696c6567656952ull, 0x0a7364726f636572ull};

typedef struct {
  uint64_t v0[4], v1[4], mul0[4], mul1[4];
} Lanes;

typedef void (*PacketsFn)(const uint8_t*, size_t, Lanes*);

typedef struct {
  Lanes s;
  PacketsFn packets;
  uint8_t carry[32];
  size_t carried;
} Hasher;

static void hasher_init(Hasher* h, PacketsFn packets) {
  h->packets = packets;
  for (int i = 0; i < 4; i++) {
    const uint64_t k = kRiegeliKey[i];
    h->s.mul0[i] = kInitMul0[i];
    h->s.mul1[i] = kInitMul1[i];
    h->s.v0[i] = kInitMul0[i] ^ k;
    h->s.v1[i] = kInitMul1[i] ^ ((k >> 32) | (k << 32));
  }
  h->carried = 0;
}

static inline void zipper_add(uint64_t v1, uint64_t v0, uint64_t* add1, uint64_t* add0) {
  *add0 += (((v0 & 0xff000000ull) | (v1 & 0xff00000000ull)) >> 24) |
           (((v0 & 0xff0000000000ull) | (v1 & 0xff000000000000ull)) >> 16) |
           (v0 & 0xff0000ull) | ((v0 & 0xff00ull) << 32) |
           ((v1 & 0xff00000000000000ull) >> 8) | (v0 << 56);
  *add1 += (((v1 & 0xff000000ull) | (v0 & 0xff00000000ull)) >> 24) |
           (v1 & 0xff0000ull) | ((v1 & 0xff0000000000ull) >> 16) |
           ((v1 & 0xff00ull) << 24) | ((v0 & 0xff000000000000ull) >> 8) |
           ((v1 & 0xffull) << 48) | (v0 & 0xff00000000000000ull);
}

static inline uint64_t load_le64(const uint8_t* p) {
  uint64_t x;
  memcpy(&x, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  x = __builtin_bswap64(x);
#endif
  return x;
}

static inline void update_lanes(const uint64_t in[4], Lanes* s) {
  for (int i = 0; i < 4; i++) {
    s->v1[i] += s->mul0[i] + in[i];
    s->mul0[i] ^= (s->v1[i] & 0xffffffffull) * (s->v0[i] >> 32);
    s->v0[i] += s->mul1[i];
    s->mul1[i] ^= (s->v0[i] & 0xffffffffull) * (s->v1[i] >> 32);
  }
  zipper_add(s->v1[1], s->v1[0], &s->v0[1], &s->v0[0]);
  zipper_add(s->v1[3], s->v1[2], &s->v0[3], &s->v0[2]);
  zipper_add(s->v0[1], s->v0[0], &s->v1[1], &s->v1[0]);
  zipper_add(s->v0[3], s->v0[2], &s->v1[3], &s->v1[2]);
}

static void packets_portable(const uint8_t* p, size_t n, Lanes* s) {
  for (size_t i = 0; i < n; i++, p += 32) {
    const uint64_t in[4] = {load_le64(p), load_le64(p + 8), load_le64(p + 16), load_le64(p + 24)};
    update_lanes(in, s);
  }
}

#ifdef HAVE_X86
/* The same update on four lanes at once; the zipper merge is one byte shuffle. */
__attribute__((target("avx2"))) static void packets_avx2(const uint8_t* p, size_t n, Lanes* s) {
  const __m256i zipper = _mm256_setr_epi8(3, 12, 2, 5, 14, 1, 15, 0, 11, 4, 10, 13, 9, 6, 8, 7,
                                          3, 12, 2, 5, 14, 1, 15, 0, 11, 4, 10, 13, 9, 6, 8, 7);
  __m256i v0 = _mm256_loadu_si256((const __m256i*)s->v0);
  __m256i v1 = _mm256_loadu_si256((const __m256i*)s->v1);
  __m256i mul0 = _mm256_loadu_si256((const __m256i*)s->mul0);
  __m256i mul1 = _mm256_loadu_si256((const __m256i*)s->mul1);
  for (size_t i = 0; i < n; i++, p += 32) {
    const __m256i in = _mm256_loadu_si256((const __m256i*)p);
    v1 = _mm256_add_epi64(v1, _mm256_add_epi64(mul0, in));
    mul0 = _mm256_xor_si256(mul0, _mm256_mul_epu32(v1, _mm256_srli_epi64(v0, 32)));
    v0 = _mm256_add_epi64(v0, mul1);
    mul1 = _mm256_xor_si256(mul1, _mm256_mul_epu32(v0, _mm256_srli_epi64(v1, 32)));
    v0 = _mm256_add_epi64(v0, _mm256_shuffle_epi8(v1, zipper));
    v1 = _mm256_add_epi64(v1, _mm256_shuffle_epi8(v0, zipper));
  }
  _mm256_storeu_si256((__m256i*)s->v0, v0);
  _mm256_storeu_si256((__m256i*)s->v1, v1);
  _mm256_storeu_si256((__m256i*)s->mul0, mul0);
  _mm256_storeu_si256((__m256i*)s->mul1, mul1);
}
#endif

/* The fastest this CPU runs, chosen at import. */
static PacketsFn best_packets = packets_portable;

static void hasher_update(Hasher* h, const uint8_t* p, size_t n) {
  if (h->carried) {
    size_t take = 32 - h->carried;
    if (take > n) take = n;
    memcpy(h->carry + h->carried, p, take);
    h->carried += take;
    p += take;
    n -= take;
    if (h->carried < 32) return;
    h->packets(h->carry, 1, &h->s);
    h->carried = 0;
  }
  const size_t whole = n / 32;
  if (whole) {
    h->packets(p, whole, &h->s);
    p += whole * 32;
    n -= whole * 32;
  }
  if (n) {
    memcpy(h->carry, p, n);
    h->carried = n;
  }
}

static inline uint32_t rotl32(uint32_t x, unsigned c) { return (x << c) | (x >> ((32 - c) & 31)); }

static uint64_t hasher_final(Hasher* h) {
  Lanes* s = &h->s;
  const size_t size_mod32 = h->carried;
  if (size_mod32) {
    const uint8_t* bytes = h->carry;
    const size_t size_mod4 = size_mod32 & 3;
    const uint8_t* rem = bytes + (size_mod32 & ~(size_t)3);
    uint8_t packet[32] = {0};
    for (int i = 0; i < 4; i++) {
      s->v0[i] += ((uint64_t)size_mod32 << 32) + size_mod32;
      const uint32_t lo = (uint32_t)s->v1[i], hi = (uint32_t)(s->v1[i] >> 32);
      s->v1[i] = (uint64_t)rotl32(lo, (unsigned)size_mod32) |
                 ((uint64_t)rotl32(hi, (unsigned)size_mod32) << 32);
    }
    memcpy(packet, bytes, (size_t)(rem - bytes));
    if (size_mod32 & 16) {
      for (int i = 0; i < 4; i++) packet[28 + i] = rem[i + size_mod4 - 4];
    } else if (size_mod4) {
      packet[16] = rem[0];
      packet[17] = rem[size_mod4 >> 1];
      packet[18] = rem[size_mod4 - 1];
    }
    packets_portable(packet, 1, s);
  }
  for (int n = 0; n < 4; n++) {
    const uint64_t p[4] = {(s->v0[2] >> 32) | (s->v0[2] << 32), (s->v0[3] >> 32) | (s->v0[3] << 32),
                           (s->v0[0] >> 32) | (s->v0[0] << 32), (s->v0[1] >> 32) | (s->v0[1] << 32)};
    update_lanes(p, s);
  }
  return s->v0[0] + s->v1[0] + s->mul0[0] + s->mul1[0];
}

static uint64_t hash_with(PacketsFn packets, const uint8_t* p, size_t n) {
  Hasher h;
  hasher_init(&h, packets);
  hasher_update(&h, p, n);
  return hasher_final(&h);
}

static uint64_t hash_bytes(const uint8_t* p, size_t n) { return hash_with(best_packets, p, n); }

/* ------------------------------------------------------------------------ */
/* Riegeli layout                                                            */

/* Skips a block header that `pos` lies in (or begins). */
static inline uint64_t past_block_header(uint64_t pos) {
  const uint64_t in_block = pos % BLOCK_SIZE;
  return in_block < BLOCK_HEADER_SIZE ? pos + (BLOCK_HEADER_SIZE - in_block) : pos;
}

/* Calls `fn` on each physical piece of `size` logical bytes from `pos`; returns
 * the position after them. */
typedef int (*PieceFn)(void* ctx, uint64_t pos, uint64_t len);
static int for_each_piece(uint64_t pos, uint64_t size, PieceFn fn, void* ctx, uint64_t* end) {
  while (size) {
    pos = past_block_header(pos);
    uint64_t n = BLOCK_SIZE - pos % BLOCK_SIZE;
    if (n > size) n = size;
    if (fn && fn(ctx, pos, n)) return -1;
    pos += n;
    size -= n;
  }
  *end = pos;
  return 0;
}

/* Where `size` logical bytes from `pos` end, in O(1): what for_each_piece's
 * walk would reach. Callers bound `size` by the extent first (`fits`), so a
 * crafted header's size can neither overflow this nor make a walk long. */
static uint64_t logical_end(uint64_t pos, uint64_t size) {
  if (size == 0) return pos; /* nothing read: not even a block header at `pos` */
  pos = past_block_header(pos);
  const uint64_t first = BLOCK_SIZE - pos % BLOCK_SIZE;
  if (size <= first) return pos + size;
  const uint64_t usable = BLOCK_SIZE - BLOCK_HEADER_SIZE;
  const uint64_t rest = size - first, full = rest / usable, rem = rest % usable;
  const uint64_t boundary = pos + first + full * BLOCK_SIZE;
  return rem ? boundary + BLOCK_HEADER_SIZE + rem : boundary;
}

/* Whether `size` logical bytes from `pos` end by `end`. Logical bytes are
 * never more than physical ones, so a size over end - pos fails before any
 * arithmetic that could overflow. */
static int fits(uint64_t pos, uint64_t size, uint64_t end) {
  return pos <= end && size <= end - pos && logical_end(pos, size) <= end;
}

/* Whether a chunk may begin at `pos`: not inside a block header nor right
 * after one (riegeli starts such a chunk at the block boundary instead, and
 * its reader refuses any other start). */
static inline int chunk_start_ok(uint64_t pos) {
  const uint64_t in_block = pos % BLOCK_SIZE;
  return in_block == 0 || in_block > BLOCK_HEADER_SIZE;
}

/* The first block boundary at or after `pos`. */
static inline uint64_t boundary_from(uint64_t pos) {
  return pos + (BLOCK_SIZE - pos % BLOCK_SIZE) % BLOCK_SIZE;
}

/* Reads exactly `n` bytes at `pos`; returns 0, or -1 with errno (0 = EOF). */
static int pread_full(int fd, uint8_t* dst, uint64_t n, uint64_t pos) {
  while (n) {
    const ssize_t got = pread(fd, dst, n > (1u << 30) ? (1u << 30) : (size_t)n, (off_t)pos);
    if (got < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    if (got == 0) {
      errno = 0;
      return -1;
    }
    dst += got;
    pos += (uint64_t)got;
    n -= (uint64_t)got;
  }
  return 0;
}

/* Reads `n` bytes at `pos` only if the page cache holds them all, without
 * sleeping (preadv2 with RWF_NOWAIT, Linux >= 4.14); 0 on success. A hit
 * takes ~1 µs, less than releasing the GIL and waiting to get it back, so
 * small reads try this first and release the GIL only when they must wait
 * for the disk. */
static int pread_cached(int fd, uint8_t* dst, uint64_t n, uint64_t pos) {
#ifdef RWF_NOWAIT
  struct iovec iov = {dst, (size_t)n};
  return preadv2(fd, &iov, 1, (off_t)pos, RWF_NOWAIT) == (ssize_t)n ? 0 : -1;
#else
  (void)fd, (void)dst, (void)n, (void)pos;
  return -1;
#endif
}

typedef struct {
  uint64_t data_size, data_hash, num_records, decoded_data_size;
  int chunk_type;
} ChunkHeader;

/* Where riegeli's reader takes the chunk at `begin` to end: after its header
 * and data or, where it holds more records than bytes, `num_records` bytes on
 * at least (the writer pads it so that every record has its own position).
 * The caller has checked that the data fits an extent that ends by 2**63;
 * num_records < 2**56: no overflow. */
static uint64_t chunk_end(uint64_t begin, uint64_t data_end, const ChunkHeader* h) {
  const uint64_t padded = begin + h->num_records;
  const uint64_t to_boundary = (BLOCK_SIZE - padded % BLOCK_SIZE) % BLOCK_SIZE;
  const uint64_t usable = BLOCK_SIZE - BLOCK_HEADER_SIZE;
  const uint64_t at_least = padded + (to_boundary > usable - 1 ? to_boundary - (usable - 1) : 0);
  return data_end > at_least ? data_end : at_least;
}

/* Why the block header `bh` (24 bytes, at `boundary`) cannot be inside the
 * chunk [begin, cend), or NULL: riegeli's reader checks every one it crosses
 * (its hash, and that it points back to the chunk's start and on to its end),
 * so a chunk whose block headers disagree is refused there too. */
static const char* block_header_error(const uint8_t* bh, uint64_t boundary, uint64_t begin,
                                      uint64_t cend) {
  if (hash_bytes(bh + 8, 16) != load_le64(bh)) return "block header hash mismatch";
  if (load_le64(bh + 8) != boundary - begin) return "block header names another chunk start";
  if (load_le64(bh + 16) != cend - boundary) return "block header names another chunk end";
  return NULL;
}

static PyObject* block_error(uint64_t begin, uint64_t boundary, const char* why) {
  PyErr_Format(PyExc_ValueError, "chunk at byte %llu: %s (the block header at byte %llu)",
               (unsigned long long)begin, why, (unsigned long long)boundary);
  return NULL;
}

/* Checks the block headers of [begin, cend) in `buf`, which holds the file
 * from `base` on, at the boundaries before `last`; NULL, or why not (with
 * the boundary in `*bad`). */
static const char* check_headers_in(const uint8_t* buf, uint64_t base, uint64_t begin,
                                    uint64_t last, uint64_t cend, uint64_t* bad) {
  for (uint64_t b = boundary_from(begin); b < last; b += BLOCK_SIZE) {
    const char* why = block_header_error(buf + (b - base), b, begin, cend);
    if (why) {
      *bad = b;
      return why;
    }
  }
  return NULL;
}

/* Copy pieces out of a buffer that holds the file from `base` on. */
typedef struct {
  const uint8_t* src;
  uint64_t base;
  uint8_t* dst;
} CopyCtx;

static int copy_piece(void* ctx, uint64_t pos, uint64_t len) {
  CopyCtx* c = (CopyCtx*)ctx;
  memcpy(c->dst, c->src + (pos - c->base), (size_t)len);
  c->dst += len;
  return 0;
}

/* Read pieces from the file into consecutive memory. */
typedef struct {
  int fd;
  uint8_t* dst;
} ReadCtx;

static int read_piece(void* ctx, uint64_t pos, uint64_t len) {
  ReadCtx* c = (ReadCtx*)ctx;
  if (pread_full(c->fd, c->dst, len, pos)) return -1;
  c->dst += len;
  return 0;
}

static PyObject* shard_error(const char* what, uint64_t begin) {
  PyErr_Format(PyExc_ValueError, "chunk at byte %llu: %s", (unsigned long long)begin, what);
  return NULL;
}

static PyObject* io_error(uint64_t begin, uint64_t end) {
  if (errno == 0) {
    PyErr_Format(PyExc_ValueError,
                 "chunk at byte %llu: the file ends before the chunk's end at byte %llu "
                 "(truncated?)",
                 (unsigned long long)begin, (unsigned long long)end);
    return NULL;
  }
  return PyErr_SetFromErrno(PyExc_OSError);
}

/* Parses and checks the 40 header bytes `h`; sets a Python error and returns -1
 * when the header is corrupt. */
static int parse_header(const uint8_t* h, uint64_t begin, ChunkHeader* out) {
  if (hash_bytes(h + 8, 32) != load_le64(h)) {
    shard_error("header hash mismatch (the chunk header is corrupt)", begin);
    return -1;
  }
  out->data_size = load_le64(h + 8);
  out->data_hash = load_le64(h + 16);
  const uint64_t type_and_count = load_le64(h + 24);
  out->chunk_type = (int)(type_and_count & 0xff);
  out->num_records = type_and_count >> 8;
  out->decoded_data_size = load_le64(h + 32);
  return 0;
}

/* Parses the (fd, begin, end) arguments of a read; sets a Python error and
 * returns -1 unless [begin, end) can hold a chunk header. */
static int check_extent(uint64_t b, uint64_t e);

static int parse_extent(PyObject* args, int* fd, uint64_t* begin, uint64_t* end) {
  unsigned long long b, e;
  if (!PyArg_ParseTuple(args, "iKK", fd, &b, &e)) return -1;
  *begin = b;
  *end = e;
  return check_extent(b, e);
}

/* Sets a Python error and returns -1 unless [b, e) can hold a chunk header. */
static int check_extent(uint64_t b, uint64_t e) {
  if (e <= b) {
    shard_error("empty extent (bad chunk offsets in the footer)", b);
    return -1;
  }
  if (e > (uint64_t)INT64_MAX) { /* past any file; and so no sum below overflows */
    shard_error("its extent ends past the largest file offset", b);
    return -1;
  }
  if (!chunk_start_ok(b)) {
    shard_error("no chunk can start there (inside or right after a block header)", b);
    return -1;
  }
  if (!fits(b, CHUNK_HEADER_SIZE, e)) {
    shard_error("its extent is shorter than a chunk header", b);
    return -1;
  }
  return 0;
}

/* After the header: the data must fit the extent, and so must the chunk as
 * riegeli sees it (with its padding). Sets `*last` to where the data ends
 * and `*cend` to where the chunk does; sets a Python error and returns -1
 * if either runs past `end`. Both bounds are O(1): a crafted data_size of
 * 2**48 costs no more than a true one. */
static int check_sizes(const ChunkHeader* h, uint64_t begin, uint64_t data_begin, uint64_t end,
                       uint64_t* last, uint64_t* cend) {
  if (!fits(data_begin, h->data_size, end)) {
    shard_error("data_size runs past the chunk's extent", begin);
    return -1;
  }
  *last = logical_end(data_begin, h->data_size);
  *cend = chunk_end(begin, *last, h);
  if (*cend > end) {
    PyErr_Format(PyExc_ValueError,
                 "chunk at byte %llu: its %llu records pad it past its extent's end at byte %llu",
                 (unsigned long long)begin, (unsigned long long)h->num_records,
                 (unsigned long long)end);
    return -1;
  }
  return 0;
}

/* Reads `n` logical bytes from physical `pos` (not inside a block header)
 * into `dst`, and the block headers between them into `headers` (24 bytes
 * each, `*num_headers` of them; room for n / 65512 + 2), with preadv: a few
 * system calls where a pread per 64 KiB block was one each. Returns 0, or -1
 * with errno (0: the file ends first). */
static int read_split(int fd, uint64_t pos, uint64_t n, uint8_t* dst, uint8_t* headers,
                      uint64_t* num_headers) {
  enum { kBatch = 256 };
  struct iovec iov[2 * kBatch];
  *num_headers = 0;
  while (n) {
    int k = 0;
    const uint64_t start = pos;
    uint64_t total = 0;
    while (n && k < 2 * kBatch - 1) {
      if (pos % BLOCK_SIZE == 0) {
        iov[k++] = (struct iovec){headers + *num_headers * BLOCK_HEADER_SIZE, BLOCK_HEADER_SIZE};
        ++*num_headers;
        pos += BLOCK_HEADER_SIZE;
        total += BLOCK_HEADER_SIZE;
      }
      uint64_t len = BLOCK_SIZE - pos % BLOCK_SIZE;
      if (len > n) len = n;
      iov[k++] = (struct iovec){dst, (size_t)len};
      dst += len;
      pos += len;
      n -= len;
      total += len;
    }
    ssize_t got;
    do {
      got = preadv(fd, iov, k, (off_t)start);
    } while (got < 0 && errno == EINTR);
    if (got != (ssize_t)total) { /* short: finish this batch piece by piece */
      uint64_t at = start;
      for (int i = 0; i < k; i++) {
        if (pread_full(fd, (uint8_t*)iov[i].iov_base, iov[i].iov_len, at)) return -1;
        at += iov[i].iov_len;
      }
    }
  }
  return 0;
}

/* The checks and copy of read_chunk on bytes already read (from an object
 * store's ranged GET): `buf` holds the file from `begin` to `end`. */
static PyObject* chunk_from(const uint8_t* buf, uint64_t begin, uint64_t end) {
  uint8_t header[CHUNK_HEADER_SIZE];
  ChunkHeader h;
  uint64_t last, cend, bad = 0, data_begin, unused;
  CopyCtx hc = {buf, begin, header};
  for_each_piece(begin, CHUNK_HEADER_SIZE, copy_piece, &hc, &data_begin);
  if (parse_header(header, begin, &h) || check_sizes(&h, begin, data_begin, end, &last, &cend))
    return NULL;
  const char* why = check_headers_in(buf, begin, begin, last, cend, &bad);
  if (why) return block_error(begin, bad, why);
  PyObject* data = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)h.data_size);
  if (!data) return NULL;
  uint8_t* dst = (uint8_t*)PyBytes_AS_STRING(data);
  CopyCtx dc = {buf, begin, dst};
  uint64_t got;
  if (h.data_size >= RELEASE_GIL_BYTES) {
    Py_BEGIN_ALLOW_THREADS
    for_each_piece(data_begin, h.data_size, copy_piece, &dc, &unused);
    got = hash_bytes(dst, (size_t)h.data_size);
    Py_END_ALLOW_THREADS
  } else {
    for_each_piece(data_begin, h.data_size, copy_piece, &dc, &unused);
    got = hash_bytes(dst, (size_t)h.data_size);
  }
  if (got != h.data_hash) {
    Py_DECREF(data);
    return shard_error("data hash mismatch (the chunk's data is corrupt)", begin);
  }
  return Py_BuildValue("iKKN", h.chunk_type, (unsigned long long)h.num_records,
                       (unsigned long long)h.decoded_data_size, data);
}

/* parse_chunk(buffer, begin) -> as read_chunk, for the chunk whose extent
 * is `buffer`, read from byte `begin` of the file. */
static PyObject* py_parse_chunk(PyObject* Py_UNUSED(self), PyObject* args) {
  Py_buffer view;
  unsigned long long b;
  if (!PyArg_ParseTuple(args, "y*K", &view, &b)) return NULL;
  PyObject* out = NULL;
  const uint64_t len = (uint64_t)view.len;
  if (b > (uint64_t)INT64_MAX - len) {
    shard_error("its extent ends past the largest file offset", b);
  } else if (!check_extent(b, b + len)) {
    out = chunk_from((const uint8_t*)view.buf, b, b + len);
  }
  PyBuffer_Release(&view);
  return out;
}

/* read_chunk(fd, begin, end) -> (chunk_type, num_records, decoded_data_size, data) */
static PyObject* py_read_chunk(PyObject* Py_UNUSED(self), PyObject* args) {
  int fd;
  uint64_t begin, end;
  if (parse_extent(args, &fd, &begin, &end)) return NULL;
  const uint64_t extent = end - begin;
  const uint64_t header_end = logical_end(begin, CHUNK_HEADER_SIZE);

  uint8_t header[CHUNK_HEADER_SIZE];
  ChunkHeader h;
  PyObject* data = NULL;
  int failed;
  uint64_t last, cend, bad = 0;
  const char* why = NULL;

  if (extent <= SMALL_EXTENT) {
    /* One pread of the whole extent, then a copy of the data out of it. */
    uint8_t* buf = (uint8_t*)malloc((size_t)extent);
    if (!buf) return PyErr_NoMemory();
    failed = pread_cached(fd, buf, extent, begin);
    if (failed) {
      Py_BEGIN_ALLOW_THREADS
      failed = pread_full(fd, buf, extent, begin);
      Py_END_ALLOW_THREADS
    }
    if (failed) {
      free(buf);
      return io_error(begin, end);
    }
    CopyCtx hc = {buf, begin, header};
    uint64_t data_begin;
    for_each_piece(begin, CHUNK_HEADER_SIZE, copy_piece, &hc, &data_begin);
    if (parse_header(header, begin, &h) ||
        check_sizes(&h, begin, data_begin, end, &last, &cend)) {
      free(buf);
      return NULL;
    }
    why = check_headers_in(buf, begin, begin, last, cend, &bad);
    if (why) {
      free(buf);
      return block_error(begin, bad, why);
    }
    data = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)h.data_size);
    if (!data) {
      free(buf);
      return NULL;
    }
    uint8_t* dst = (uint8_t*)PyBytes_AS_STRING(data);
    CopyCtx dc = {buf, begin, dst};
    uint64_t unused;
    for_each_piece(data_begin, h.data_size, copy_piece, &dc, &unused);
    free(buf);
  } else {
    /* Header first, then the data straight into the result. */
    uint8_t head[CHUNK_HEADER_SIZE + 2 * BLOCK_HEADER_SIZE];
    const uint64_t head_len = header_end - begin;
    Py_BEGIN_ALLOW_THREADS
    failed = pread_full(fd, head, head_len, begin);
    Py_END_ALLOW_THREADS
    if (failed) return io_error(begin, end);
    CopyCtx hc = {head, begin, header};
    uint64_t data_begin;
    for_each_piece(begin, CHUNK_HEADER_SIZE, copy_piece, &hc, &data_begin);
    if (parse_header(header, begin, &h) ||
        check_sizes(&h, begin, data_begin, end, &last, &cend)) {
      return NULL;
    }
    /* The block headers the chunk header spans are in `head`. */
    why = check_headers_in(head, begin, begin, data_begin < last ? data_begin : last, cend, &bad);
    if (why) return block_error(begin, bad, why);
    data = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)h.data_size);
    if (!data) return NULL;
    const uint64_t max_headers = h.data_size / (BLOCK_SIZE - BLOCK_HEADER_SIZE) + 2;
    uint8_t* headers = (uint8_t*)PyMem_Malloc((size_t)max_headers * BLOCK_HEADER_SIZE);
    if (!headers) {
      Py_DECREF(data);
      return PyErr_NoMemory();
    }
    uint64_t num_headers = 0;
    Py_BEGIN_ALLOW_THREADS
    failed = read_split(fd, data_begin, h.data_size, (uint8_t*)PyBytes_AS_STRING(data), headers,
                        &num_headers);
    if (!failed) {
      for (uint64_t i = 0, b = boundary_from(data_begin); i < num_headers && !why;
           i++, b += BLOCK_SIZE) {
        why = block_header_error(headers + i * BLOCK_HEADER_SIZE, b, begin, cend);
        bad = b;
      }
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(headers);
    if (failed || why) {
      Py_DECREF(data);
      return failed ? io_error(begin, end) : block_error(begin, bad, why);
    }
  }

  const uint8_t* bytes = (const uint8_t*)PyBytes_AS_STRING(data);
  uint64_t got;
  if (h.data_size >= RELEASE_GIL_BYTES) {
    Py_BEGIN_ALLOW_THREADS
    got = hash_bytes(bytes, (size_t)h.data_size);
    Py_END_ALLOW_THREADS
  } else {
    got = hash_bytes(bytes, (size_t)h.data_size);
  }
  if (got != h.data_hash) {
    Py_DECREF(data);
    return shard_error("data hash mismatch (the chunk's data is corrupt)", begin);
  }
  PyObject* out = Py_BuildValue("iKKN", h.chunk_type, (unsigned long long)h.num_records,
                                (unsigned long long)h.decoded_data_size, data);
  return out;
}

/* ------------------------------------------------------------------------ */
/* One record, read straight into place                                      */
/*
 * Two reads per record: the chunk header with the data's framing, then one
 * preadv for everything else (payloads into the result, block headers aside).
 * A pread per piece was ~6 system calls for a 150 KiB record and ~8% of its
 * read time.
 */

static int read_varint(const uint8_t** p, const uint8_t* end, uint64_t* out);

/* Reads `n` logical bytes at logical offset `x` of data that begins at
 * physical `data_begin`. */
static int read_logical(int fd, uint64_t data_begin, uint64_t x, uint64_t n, uint8_t* dst) {
  ReadCtx rc = {fd, dst};
  uint64_t unused;
  return for_each_piece(logical_end(data_begin, x), n, read_piece, &rc, &unused);
}

/* What a zstd frame header says (RFC 8878 §3.1.1.1). */
typedef struct {
  uint64_t length;       /* magic number to the first block header */
  uint64_t content_size; /* UINT64_MAX: not declared */
  uint64_t block_max;    /* the largest block it may hold: min(window, 128 KiB) */
  int checksum;          /* 4 bytes of checksum follow the last block */
} FrameHeader;

#define ZSTD_BLOCK_MAX (128u << 10)
#define ZSTD_WINDOW_MAX (1u << 27) /* libzstd's default limit when decoding */

/* Parses the frame header at p[0, n). 1 when it is one libzstd decodes with
 * its default limits and no dictionary; 0 otherwise (or cut short): the
 * caller then leaves the frame to libzstd, which decides. */
static int zstd_header(const uint8_t* p, uint64_t n, FrameHeader* f) {
  if (n < 5 || p[0] != 0x28 || p[1] != 0xb5 || p[2] != 0x2f || p[3] != 0xfd) return 0;
  const uint8_t fhd = p[4];
  if (fhd & 0x08) return 0; /* reserved bit */
  if (fhd & 0x03) return 0; /* a dictionary id */
  const int single_segment = (fhd >> 5) & 1, fcs_flag = fhd >> 6;
  const int fcs_bytes = fcs_flag == 0 ? single_segment : (1 << fcs_flag);
  uint64_t at = 5, window = 0;
  if (!single_segment) {
    if (at >= n) return 0;
    const unsigned exponent = p[at] >> 3, mantissa = p[at] & 7;
    const uint64_t base = 1ull << (10 + exponent);
    window = base + (base >> 3) * mantissa;
    at++;
  }
  if (at + (uint64_t)fcs_bytes > n) return 0;
  f->content_size = UINT64_MAX;
  if (fcs_bytes) {
    uint64_t v = 0;
    for (int i = 0; i < fcs_bytes; i++) v |= (uint64_t)p[at + i] << (8 * i);
    f->content_size = fcs_bytes == 2 ? v + 256 : v;
    at += (uint64_t)fcs_bytes;
  }
  if (single_segment) window = f->content_size;
  if (window > ZSTD_WINDOW_MAX) return 0;
  f->block_max = window < ZSTD_BLOCK_MAX ? window : ZSTD_BLOCK_MAX;
  f->checksum = (fhd >> 2) & 1;
  f->length = at;
  return 1;
}

/* Whether p[0, n) is a zstd frame of one raw block and nothing else (what
 * zstd makes of a few bytes: a record's size); sets its payload. */
static int single_raw_block(const uint8_t* p, uint64_t n, const uint8_t** payload,
                            uint64_t* len) {
  FrameHeader f;
  if (!zstd_header(p, n, &f) || f.checksum || n - f.length < 3) return 0;
  const uint8_t* b = p + f.length;
  const uint32_t word = (uint32_t)b[0] | ((uint32_t)b[1] << 8) | ((uint32_t)b[2] << 16);
  const uint64_t size = word >> 3;
  if (!(word & 1) || ((word >> 1) & 3) != 0) return 0; /* not one last raw block */
  if (size > f.block_max || f.length + 3 + size != n) return 0;
  if (f.content_size != UINT64_MAX && f.content_size != size) return 0;
  *payload = b + 3;
  *len = size;
  return 1;
}

/* The sizes part of a one-record simple chunk, p[0, n): 1 with `*value` when
 * it is one varint (as riegeli requires), -1 when it is certainly not, 0
 * when telling needs libzstd (a frame of another shape). */
static int one_size(const uint8_t* p, uint64_t n, int compression, uint64_t* value) {
  const uint8_t* end = p + n;
  if (compression == 'z') {
    uint64_t declared, len;
    if (read_varint(&p, end, &declared)) return -1;
    if (!single_raw_block(p, (uint64_t)(end - p), &p, &len)) return 0;
    if (len != declared) return -1;
    end = p + len;
  } else if (compression != 0) {
    return 0;
  }
  if (read_varint(&p, end, value) || p != end) return -1;
  return 1;
}

#define MAX_RAW_BLOCKS 64     /* zstd raw blocks are <= 128 KiB: records to 8 MiB */
#define HEAD_READ 512         /* chunk header and the data's framing, in one pread */

/* Where a one-record chunk's bytes lie: the record is the concatenation of
 * `num` payloads, each preceded in the data by a 3-byte zstd block header
 * (none for uncompressed data); `framing` bytes come first. */
typedef struct {
  uint64_t framing;                       /* data bytes before the first payload */
  uint64_t payload_at[MAX_RAW_BLOCKS];    /* logical data offset of each payload */
  uint64_t payload_len[MAX_RAW_BLOCKS];
  uint8_t block_header[MAX_RAW_BLOCKS][3];/* the header before payload k (k >= 1) */
  int num;
} Layout;

/* Fills `lay` from the data's first bytes (`prefix`, `have` of them). Block
 * headers past the prefix are read from the file (a pread each) or, with
 * `guess`, assumed: zstd cuts incompressible data into raw blocks of one size,
 * the last one shorter, so the headers follow from the first and the decoded
 * size. `read_guessed` reads the assumed headers with the payloads and checks
 * them. Returns 1 when the record can be read straight into place, 0 when not
 * (compressed blocks, another framing, anything ArrayRecord might refuse:
 * the general path then decides), -1 on an I/O error. The data hash,
 * checked after, vouches for the bytes; this, for their structure. */
static int plan_record(int fd, uint64_t data_begin, uint64_t data_size, uint64_t decoded,
                       const uint8_t* prefix, size_t have, int guess, Layout* lay) {
  const uint8_t* p = prefix;
  const uint8_t* end = prefix + have;
  uint64_t sizes_len, v;
  if (have < 2) return 0;
  const uint8_t compression = *p++;
  if (read_varint(&p, end, &sizes_len) || sizes_len > (uint64_t)(end - p)) return 0;
  if (one_size(p, sizes_len, compression, &v) != 1 || v != decoded) return 0;
  p += sizes_len;
  lay->num = 0;
  if (compression == 0) {
    lay->framing = (uint64_t)(p - prefix);
    if (lay->framing > data_size || data_size - lay->framing != decoded) return 0;
    lay->payload_at[0] = lay->framing;
    lay->payload_len[0] = decoded;
    lay->num = 1;
    return 1;
  }
  if (compression != 'z') return 0;
  if (read_varint(&p, end, &v) || v != decoded) return 0;
  FrameHeader f;
  if (!zstd_header(p, (uint64_t)(end - p), &f)) return 0;
  if (f.checksum) return 0; /* riegeli does not write one */
  if (f.content_size != UINT64_MAX && f.content_size != decoded) return 0;
  if (f.length + 3 > (uint64_t)(end - p)) return 0;
  p += f.length;
  uint64_t at = (uint64_t)(p - prefix); /* logical offset of the first block header */
  lay->framing = at + 3;
  uint64_t total = 0;
  for (;;) {
    uint8_t bh[3];
    if (at + 3 > data_size || lay->num == MAX_RAW_BLOCKS) return 0;
    if (at + 3 <= have) {
      memcpy(bh, prefix + at, 3);
    } else if (guess) {
      const uint64_t block = lay->payload_len[0], left = decoded - total;
      if (lay->num == 0 || block == 0 || total >= decoded) return 0;
      const uint64_t size = left < block ? left : block;
      const uint32_t word = (uint32_t)(size << 3) | (size == left ? 1u : 0u);
      bh[0] = (uint8_t)word, bh[1] = (uint8_t)(word >> 8), bh[2] = (uint8_t)(word >> 16);
    } else if (read_logical(fd, data_begin, at, 3, bh)) {
      return -1;
    }
    const uint32_t word = (uint32_t)bh[0] | ((uint32_t)bh[1] << 8) | ((uint32_t)bh[2] << 16);
    const uint64_t size = word >> 3;
    if (((word >> 1) & 3) != 0) return 0; /* not a raw block */
    if (size > f.block_max) return 0;     /* libzstd refuses it */
    if (lay->num > 0) memcpy(lay->block_header[lay->num], bh, 3);
    lay->payload_at[lay->num] = at + 3;
    lay->payload_len[lay->num] = size;
    lay->num++;
    total += size;
    at += 3 + size;
    if (word & 1) break; /* last block */
  }
  if (at != data_size || total != decoded) return 0;
  return 1;
}

/* One preadv's list: the physical pieces of logical ranges of the data, each
 * to its destination, the riegeli block headers between them aside (checked
 * after); and where the zstd block headers read land. */
#define MAX_IOVECS 1024
typedef struct {
  struct iovec iov[MAX_IOVECS];
  int n;
  uint64_t start, next; /* physical: where the read begins, where it has got to */
  uint8_t* dst;
  uint8_t block_headers[MAX_IOVECS / 2][BLOCK_HEADER_SIZE];
  uint64_t block_header_at[MAX_IOVECS / 2];
  int num_block_headers;
  uint8_t headers[MAX_RAW_BLOCKS][3];
} Gather;

static int gather_piece(void* ctx, uint64_t pos, uint64_t len) {
  Gather* g = (Gather*)ctx;
  if (g->n == 0) {
    g->start = g->next = pos;
  } else if (pos != g->next) { /* a block header between two pieces */
    if (pos - g->next != BLOCK_HEADER_SIZE || g->next % BLOCK_SIZE || g->n == MAX_IOVECS ||
        g->num_block_headers == MAX_IOVECS / 2) {
      return -1;
    }
    g->block_header_at[g->num_block_headers] = g->next;
    g->iov[g->n++] = (struct iovec){g->block_headers[g->num_block_headers++], BLOCK_HEADER_SIZE};
  }
  if (g->n == MAX_IOVECS) return -1;
  g->iov[g->n++] = (struct iovec){g->dst, (size_t)len};
  g->dst += len;
  g->next = pos + len;
  return 0;
}

static int gather(Gather* g, uint64_t data_begin, uint64_t x, uint64_t n, uint8_t* dst) {
  uint64_t unused;
  g->dst = dst;
  return for_each_piece(logical_end(data_begin, x), n, gather_piece, g, &unused);
}

/* Reads a planned record's payloads into `dst` and its later zstd block
 * headers, with one preadv instead of a pread per piece and per header.
 * Returns 0 when the headers read are the ones planned, 1 when not (a guess
 * was wrong) or the read fell short: the caller then reads piece by piece. */
static int read_guessed(int fd, uint64_t data_begin, const Layout* lay, uint8_t* dst, Gather* g) {
  g->n = 0;
  g->num_block_headers = 0;
  uint64_t total = 0;
  for (int k = 0; k < lay->num; k++) {
    if (k > 0 && gather(g, data_begin, lay->payload_at[k] - 3, 3, g->headers[k])) return 1;
    if (gather(g, data_begin, lay->payload_at[k], lay->payload_len[k], dst)) return 1;
    dst += lay->payload_len[k];
  }
  for (int i = 0; i < g->n; i++) total += g->iov[i].iov_len;
  ssize_t got;
  do {
    got = preadv(fd, g->iov, g->n, (off_t)g->start);
  } while (got < 0 && errno == EINTR);
  if (got != (ssize_t)total) return 1;
  for (int k = 1; k < lay->num; k++) {
    if (memcmp(g->headers[k], lay->block_header[k], 3) != 0) return 1;
  }
  return 0;
}

/* Checks the block headers of the chunk [begin, cend) at the boundaries
 * before `last`, each taken from `head` (the file from `begin` on,
 * `head_len` bytes), from `g` (read with the payloads), else read here.
 * Returns 0; 1 with `*bad` and `*why` for one that is wrong; -1 when a read
 * fails. */
static int check_record_headers(int fd, uint64_t begin, uint64_t last, uint64_t cend,
                                const uint8_t* head, uint64_t head_len, const Gather* g,
                                uint64_t* bad, const char** why) {
  int j = 0;
  for (uint64_t b = boundary_from(begin); b < last; b += BLOCK_SIZE) {
    uint8_t own[BLOCK_HEADER_SIZE];
    const uint8_t* bh;
    while (j < g->num_block_headers && g->block_header_at[j] < b) j++;
    if (b + BLOCK_HEADER_SIZE <= begin + head_len) {
      bh = head + (b - begin);
    } else if (j < g->num_block_headers && g->block_header_at[j] == b) {
      bh = g->block_headers[j];
    } else {
      if (pread_full(fd, own, BLOCK_HEADER_SIZE, b)) return -1;
      bh = own;
    }
    *why = block_header_error(bh, b, begin, cend);
    if (*why) {
      *bad = b;
      return 1;
    }
  }
  return 0;
}

/* read_record(fd, begin, end) -> bytes | None */
static PyObject* py_read_record(PyObject* Py_UNUSED(self), PyObject* args) {
  int fd;
  uint64_t begin, end;
  if (parse_extent(args, &fd, &begin, &end)) return NULL;

  /* The chunk header and the start of its data, in one read. */
  uint8_t head[HEAD_READ + 3 * BLOCK_HEADER_SIZE];
  const uint64_t head_len = end - begin < sizeof head ? end - begin : sizeof head;
  int failed = pread_cached(fd, head, head_len, begin);
  if (failed) {
    Py_BEGIN_ALLOW_THREADS
    failed = pread_full(fd, head, head_len, begin);
    Py_END_ALLOW_THREADS
  }
  if (failed) return io_error(begin, end);
  uint8_t header[CHUNK_HEADER_SIZE];
  CopyCtx hc = {head, begin, header};
  uint64_t data_begin, last, cend;
  for_each_piece(begin, CHUNK_HEADER_SIZE, copy_piece, &hc, &data_begin);
  ChunkHeader h;
  if (parse_header(header, begin, &h)) return NULL;
  if (check_sizes(&h, begin, data_begin, end, &last, &cend)) return NULL;
  if (h.chunk_type != 'r' || h.num_records != 1) Py_RETURN_NONE;

  /* The data's first bytes, as far as the head read them. */
  uint8_t prefix[HEAD_READ];
  size_t have = 0;
  {
    uint64_t pos = data_begin, left = h.data_size;
    while (left && have < sizeof prefix) {
      pos = past_block_header(pos);
      if (pos >= begin + head_len) break;
      uint64_t n = BLOCK_SIZE - pos % BLOCK_SIZE;
      if (n > left) n = left;
      if (n > begin + head_len - pos) n = begin + head_len - pos;
      if (n > sizeof prefix - have) n = sizeof prefix - have;
      memcpy(prefix + have, head + (pos - begin), (size_t)n);
      have += (size_t)n;
      pos += n;
      left -= n;
    }
  }
  Layout* lay = (Layout*)PyMem_Malloc(sizeof(Layout));
  if (!lay) return PyErr_NoMemory();
  int plan = plan_record(fd, data_begin, h.data_size, h.decoded_data_size, prefix, have, 1, lay);
  if (plan <= 0) {
    plan = plan_record(fd, data_begin, h.data_size, h.decoded_data_size, prefix, have, 0, lay);
  }
  if (plan <= 0 || lay->framing > have) {
    PyMem_Free(lay);
    if (plan < 0) return io_error(begin, end);
    Py_RETURN_NONE;
  }
  Gather* g = (Gather*)PyMem_Malloc(sizeof(Gather));
  if (!g) {
    PyMem_Free(lay);
    return PyErr_NoMemory();
  }

  PyObject* out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)h.decoded_data_size);
  if (!out) {
    PyMem_Free(lay);
    PyMem_Free(g);
    return NULL;
  }
  uint8_t* dst = (uint8_t*)PyBytes_AS_STRING(out);
  uint64_t got = 0, bad = 0;
  const char* why = NULL;
  int replan = 1, headers = 0;
  Py_BEGIN_ALLOW_THREADS
  uint8_t* at = dst;
  if (read_guessed(fd, data_begin, lay, dst, g)) {
    /* A guessed block header was wrong: plan from the headers in the file. */
    g->num_block_headers = 0;
    replan = plan_record(fd, data_begin, h.data_size, h.decoded_data_size, prefix, have, 0, lay);
    failed = replan != 1;
    for (int k = 0; k < lay->num && !failed; k++) {
      failed = read_logical(fd, data_begin, lay->payload_at[k], lay->payload_len[k], at);
      at += lay->payload_len[k];
    }
  }
  if (!failed) {
    /* The data hash over the data as stored: the framing, then each payload
     * with the block header before it. */
    Hasher hs;
    hasher_init(&hs, best_packets);
    hasher_update(&hs, prefix, (size_t)lay->framing);
    at = dst;
    for (int k = 0; k < lay->num; k++) {
      if (k > 0) hasher_update(&hs, lay->block_header[k], 3);
      hasher_update(&hs, at, (size_t)lay->payload_len[k]);
      at += lay->payload_len[k];
    }
    got = hasher_final(&hs);
    headers = check_record_headers(fd, begin, last, cend, head, head_len, g, &bad, &why);
    failed = headers < 0;
  }
  Py_END_ALLOW_THREADS
  PyMem_Free(lay);
  PyMem_Free(g);
  if (failed) {
    Py_DECREF(out);
    if (replan == 0) Py_RETURN_NONE; /* not raw blocks after all */
    return io_error(begin, end);
  }
  if (got != h.data_hash) {
    Py_DECREF(out);
    return shard_error("data hash mismatch (the chunk's data is corrupt)", begin);
  }
  if (headers) {
    Py_DECREF(out);
    return block_error(begin, bad, why);
  }
  return out;
}

/* ------------------------------------------------------------------------ */
/* Varints and the footer's messages                                         */

static int read_varint(const uint8_t** p, const uint8_t* end, uint64_t* out) {
  uint64_t v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (*p >= end) return -1;
    const uint8_t b = *(*p)++;
    if (shift == 63 && b > 1) return -1; /* bits past 64: riegeli refuses them too */
    v |= (uint64_t)(b & 0x7f) << shift;
    if (b < 0x80) {
      *out = v;
      return 0;
    }
  }
  return -1;
}

/* varints(buffer, count[, total]) -> bytes: `count` varints as little-endian
 * uint64s, nothing after them; with `total`, they must add up to it (each
 * checked against what is left of it, as riegeli does: no sum overflows). */
static PyObject* py_varints(PyObject* Py_UNUSED(self), PyObject* args) {
  Py_buffer view;
  Py_ssize_t count;
  unsigned long long total = 0;
  int has_total = PyTuple_GET_SIZE(args) > 2;
  if (!PyArg_ParseTuple(args, "y*n|K", &view, &count, &total)) return NULL;
  if (count < 0 || count > view.len) {
    PyBuffer_Release(&view);
    PyErr_Format(PyExc_ValueError, "%zd varints cannot fit in %zd bytes", count, view.len);
    return NULL;
  }
  PyObject* out = PyBytes_FromStringAndSize(NULL, count * 8);
  if (!out) {
    PyBuffer_Release(&view);
    return NULL;
  }
  uint64_t* dst = (uint64_t*)PyBytes_AS_STRING(out);
  const uint8_t* p = (const uint8_t*)view.buf;
  const uint8_t* end = p + view.len;
  uint64_t left = total;
  for (Py_ssize_t i = 0; i < count; i++) {
    uint64_t v;
    if (read_varint(&p, end, &v)) {
      PyBuffer_Release(&view);
      Py_DECREF(out);
      PyErr_Format(PyExc_ValueError, "varint %zd of %zd is truncated or too long", i, count);
      return NULL;
    }
    if (has_total && v > left) {
      PyBuffer_Release(&view);
      Py_DECREF(out);
      PyErr_Format(PyExc_ValueError, "record sizes add up to more than the chunk's %llu bytes",
                   total);
      return NULL;
    }
    left -= v;
    dst[i] = v;
  }
  const Py_ssize_t extra = (Py_ssize_t)(end - p);
  PyBuffer_Release(&view);
  if (extra) {
    Py_DECREF(out);
    PyErr_Format(PyExc_ValueError, "%zd bytes follow the last of %zd varints", extra, count);
    return NULL;
  }
  if (has_total && left) {
    Py_DECREF(out);
    PyErr_Format(PyExc_ValueError, "record sizes add up to %llu bytes less than the chunk's %llu",
                 (unsigned long long)left, total);
    return NULL;
  }
  return out;
}

/* one_size(part, compression) -> int | None: the one record size in a
 * one-record chunk's sizes part, when that takes no libzstd (None: it
 * does); ValueError when the part is certainly not one varint. */
static PyObject* py_one_size(PyObject* Py_UNUSED(self), PyObject* args) {
  Py_buffer view;
  int compression;
  if (!PyArg_ParseTuple(args, "y*i", &view, &compression)) return NULL;
  uint64_t value = 0;
  const int found = one_size((const uint8_t*)view.buf, (uint64_t)view.len, compression, &value);
  PyBuffer_Release(&view);
  if (found < 0) {
    PyErr_SetString(PyExc_ValueError, "the record sizes are not one varint");
    return NULL;
  }
  if (!found) Py_RETURN_NONE;
  return PyLong_FromUnsignedLongLong(value);
}

/* message_field(values, sizes, field) -> bytes: for each message (sizes: uint64s,
 * values: the messages back to back), its varint field `field` (0 if absent). */
static PyObject* py_message_field(PyObject* Py_UNUSED(self), PyObject* args) {
  Py_buffer values, sizes;
  unsigned int field;
  if (!PyArg_ParseTuple(args, "y*y*I", &values, &sizes, &field)) return NULL;
  PyObject* out = NULL;
  const Py_ssize_t count = sizes.len / 8;
  const uint64_t* size_of = (const uint64_t*)sizes.buf;
  const uint8_t* p = (const uint8_t*)values.buf;
  const uint8_t* values_end = p + values.len;
  if (sizes.len % 8) {
    PyErr_SetString(PyExc_ValueError, "sizes must be uint64s");
    goto done;
  }
  out = PyBytes_FromStringAndSize(NULL, count * 8);
  if (!out) goto done;
  uint64_t* dst = (uint64_t*)PyBytes_AS_STRING(out);
  for (Py_ssize_t i = 0; i < count; i++) {
    if (size_of[i] > (uint64_t)(values_end - p)) goto corrupt;
    const uint8_t* end = p + size_of[i];
    uint64_t found = 0;
    while (p < end) {
      uint64_t key, v;
      if (read_varint(&p, end, &key)) goto corrupt;
      switch (key & 7) {
        case 0:
          if (read_varint(&p, end, &v)) goto corrupt;
          if ((key >> 3) == field) found = v;
          break;
        case 1:
          if (end - p < 8) goto corrupt;
          p += 8;
          break;
        case 2:
          if (read_varint(&p, end, &v) || v > (uint64_t)(end - p)) goto corrupt;
          p += v;
          break;
        case 5:
          if (end - p < 4) goto corrupt;
          p += 4;
          break;
        default:
          goto corrupt;
      }
    }
    dst[i] = found;
    continue;
  corrupt:
    Py_DECREF(out);
    out = NULL;
    PyErr_Format(PyExc_ValueError, "footer message %zd of %zd is malformed", i, count);
    goto done;
  }
done:
  PyBuffer_Release(&values);
  PyBuffer_Release(&sizes);
  return out;
}

/* ------------------------------------------------------------------------ */

static PyObject* py_hash(PyObject* Py_UNUSED(self), PyObject* args) {
  Py_buffer view;
  int portable = 0;
  if (!PyArg_ParseTuple(args, "y*|p", &view, &portable)) return NULL;
  const PacketsFn fn = portable ? packets_portable : best_packets;
  uint64_t h;
  if ((size_t)view.len >= RELEASE_GIL_BYTES) {
    Py_BEGIN_ALLOW_THREADS
    h = hash_with(fn, (const uint8_t*)view.buf, (size_t)view.len);
    Py_END_ALLOW_THREADS
  } else {
    h = hash_with(fn, (const uint8_t*)view.buf, (size_t)view.len);
  }
  PyBuffer_Release(&view);
  return PyLong_FromUnsignedLongLong(h);
}

static PyObject* py_simd(PyObject* Py_UNUSED(self), PyObject* Py_UNUSED(unused)) {
#ifdef HAVE_X86
  if (best_packets == packets_avx2) return PyUnicode_FromString("avx2");
#endif
  return PyUnicode_FromString("portable");
}

/* zstd_frame(buffer) -> (length, content_size): the bytes of the zstd frame
 * that `buffer` starts with (RFC 8878 §3.1.1: header, blocks, optional
 * checksum) and the content size its header declares (-1: none); -1 for the
 * length when the frame is cut short or malformed. In C: the reader checks
 * every small record's frame, and a Python walk cost ~1.5 µs of ~6. */
static PyObject* py_zstd_frame(PyObject* Py_UNUSED(self), PyObject* args) {
  Py_buffer view;
  if (!PyArg_ParseTuple(args, "y*", &view)) return NULL;
  const uint8_t* p = (const uint8_t*)view.buf;
  const uint64_t n = (uint64_t)view.len;
  long long length = -1, content = -1;
  FrameHeader f;
  /* A frame libzstd would not stream-decode with its defaults (a dictionary,
   * a window over 128 MiB), or a block over the window (one-shot decoding
   * lets that through; ArrayRecord's streaming reader does not) is malformed. */
  if (zstd_header(p, n, &f)) {
    if (f.content_size != UINT64_MAX)
      content = f.content_size > (uint64_t)LLONG_MAX ? LLONG_MAX : (long long)f.content_size;
    uint64_t at = f.length;
    for (;;) {
      if (at + 3 > n) break;
      const uint32_t word = (uint32_t)p[at] | ((uint32_t)p[at + 1] << 8) |
                            ((uint32_t)p[at + 2] << 16);
      const uint32_t kind = (word >> 1) & 3, size = word >> 3;
      if (kind == 3 || size > f.block_max) break;
      at += 3 + (kind == 1 ? 1 : size);
      if (word & 1) {
        at += f.checksum ? 4 : 0;
        if (at <= n) length = (long long)at;
        break;
      }
    }
  }
  PyBuffer_Release(&view);
  return Py_BuildValue("LL", length, content);
}

static PyMethodDef methods[] = {
    {"hash", py_hash, METH_VARARGS,
     "hash(buffer, portable=False) -> int: HighwayHash-64 with riegeli's key\n"
     "(portable: the plain-C lanes even where AVX2 runs, for tests)."},
    {"read_chunk", py_read_chunk, METH_VARARGS,
     "read_chunk(fd, begin, end) -> (chunk_type, num_records, decoded_data_size, data)\n\n"
     "Reads the chunk at [begin, end) of a riegeli file, checks its header and data\n"
     "hashes, and returns its data with the block headers taken out. Raises\n"
     "ValueError naming the chunk when it is corrupt or truncated, OSError on I/O."},
    {"parse_chunk", py_parse_chunk, METH_VARARGS,
     "parse_chunk(buffer, begin) -> as read_chunk, for a chunk whose extent (from byte\n"
     "`begin` of the file) was read already: `buffer`, from an object store's\n"
     "ranged read. Raises ValueError naming the chunk when it is corrupt."},
    {"read_record", py_read_record, METH_VARARGS,
     "read_record(fd, begin, end) -> bytes | None\n\n"
     "The record of a one-record simple chunk whose data is uncompressed or a zstd\n"
     "frame of raw blocks (what zstd stores for incompressible records), read\n"
     "straight into the result, hashes checked; None for any other chunk. Raises\n"
     "as read_chunk does."},
    {"zstd_frame", py_zstd_frame, METH_VARARGS,
     "zstd_frame(buffer) -> (length, content_size): the zstd frame buffer starts with\n"
     "(length -1: cut short or malformed; content_size -1: not declared)."},
    {"varints", py_varints, METH_VARARGS,
     "varints(buffer, count[, total]) -> bytes: `count` varints as uint64s, all of\n"
     "`buffer`; with `total`, what they must add up to. ValueError otherwise."},
    {"one_size", py_one_size, METH_VARARGS,
     "one_size(part, compression) -> int | None: the record size in a one-record\n"
     "chunk's sizes part (None: decompress it to tell). ValueError if malformed."},
    {"message_field", py_message_field, METH_VARARGS,
     "message_field(values, sizes, field) -> bytes: varint field `field` of each\n"
     "message (0 where absent), as uint64s."},
    {"simd", py_simd, METH_NOARGS, "simd() -> 'avx2' or 'portable': the hash in use."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_riegeli",
                                    "Reads and verifies riegeli chunks (ArrayRecord shards).",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__riegeli(void) {
#ifdef HAVE_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) best_packets = packets_avx2;
#endif
  PyObject* m = PyModule_Create(&module);
  /* Chunks up to this size are read with one pread and a copy (read_chunk). */
  if (m && PyModule_AddIntConstant(m, "SMALL_EXTENT", SMALL_EXTENT)) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
