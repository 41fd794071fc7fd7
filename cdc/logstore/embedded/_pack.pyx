# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""The embedded store's append in C (issue #34): an append's records placed by Kafka's partitioner
and written as each partition's stored batch, in one pass, each record's bytes copied once (into a
bytes object of the batch's exact size, computed first). The records come as a list of ``Record``
or as the reader's batch holds them, :class:`cdc.logstore._records.Records` (read as they are, no
object per record).

The Python reference is :func:`cdc.logstore.embedded.placing.stored_rows`, then
``msgspec.msgpack.Encoder().encode`` of each partition's ``StoredRow`` list, with
:func:`cdc.logstore.partition_arrays.partition_array` placing the keys; ``tests/logstore/test_pack.py``
holds the two byte-identical. :func:`group_pack` answers None for an append it does not take (a
record naming its partition, with headers or a timestamp, a key or value that is not ``bytes``):
the reference path takes it and names what is wrong.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

from cdc.logstore._records cimport Records, Span

#: what cdc.logstore.embedded.store expects of this module
ABI = 2


cdef uint32_t _murmur2(const unsigned char *data, Py_ssize_t length):
    """Kafka's murmur2 (cdc.logstore.partitioner.murmur2), unsigned."""
    cdef uint32_t m = 0x5BD1E995
    cdef uint32_t h = (<uint32_t>0x9747B28C) ^ (<uint32_t>length)
    cdef uint32_t k
    cdef Py_ssize_t i, words = length >> 2, base = length & ~3
    for i in range(words):
        k = (<uint32_t>data[4 * i]) | (<uint32_t>data[4 * i + 1] << 8) | (<uint32_t>data[4 * i + 2] << 16) | (<uint32_t>data[4 * i + 3] << 24)
        k *= m
        k ^= k >> 24
        k *= m
        h *= m
        h ^= k
    cdef Py_ssize_t extra = length & 3
    if extra >= 3:
        h ^= (<uint32_t>data[base + 2]) << 16
    if extra >= 2:
        h ^= (<uint32_t>data[base + 1]) << 8
    if extra >= 1:
        h ^= data[base]
        h *= m
    h ^= h >> 13
    h *= m
    h ^= h >> 15
    return h


def partition_of(bytes key, int partitions):
    """:func:`cdc.logstore.partitioner.partition_for` in C (for the tests)."""
    return (_murmur2(<const unsigned char *>PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key)) & 0x7FFFFFFF) % partitions


cdef struct Buf:
    char *p        # a bytes object's, of the batch's exact size (computed first)
    Py_ssize_t n
    Py_ssize_t cap


cdef inline Py_ssize_t _uint_size(uint64_t v) noexcept:
    """The bytes :func:`_uint` writes for ``v``."""
    if v < 128:
        return 1
    if v <= 0xFF:
        return 2
    if v <= 0xFFFF:
        return 3
    if v <= 0xFFFFFFFF:
        return 5
    return 9


cdef inline Py_ssize_t _bin_size(Py_ssize_t size) noexcept:
    """The bytes :func:`_bin` writes for ``size`` bytes."""
    return size + (2 if size <= 0xFF else (3 if size <= 0xFFFF else 5))


cdef inline Py_ssize_t _array_head_size(Py_ssize_t n) noexcept:
    return 1 if n < 16 else (3 if n <= 0xFFFF else 5)


cdef inline int _reserve(Buf *b, Py_ssize_t more) except -1:
    """Room for ``more`` bytes: the batch was sized exactly, so there is (else a bug, not a write
    past its end)."""
    if b.n + more > b.cap:
        raise SystemError("group_pack: a partition's batch is longer than its size computed (a bug)")
    return 0


cdef inline void _u8(Buf *b, unsigned char c):
    b.p[b.n] = <char>c
    b.n += 1


cdef inline void _be(Buf *b, uint64_t v, int size):
    cdef int i
    for i in range(size):
        b.p[b.n + i] = <char>((v >> (8 * (size - 1 - i))) & 0xFF)
    b.n += size


cdef int _uint(Buf *b, uint64_t v) except -1:
    """A non-negative int as msgspec writes it (the shortest form)."""
    _reserve(b, _uint_size(v))
    if v < 128:
        _u8(b, <unsigned char>v)
    elif v <= 0xFF:
        _u8(b, 0xCC)
        _be(b, v, 1)
    elif v <= 0xFFFF:
        _u8(b, 0xCD)
        _be(b, v, 2)
    elif v <= 0xFFFFFFFF:
        _u8(b, 0xCE)
        _be(b, v, 4)
    else:
        _u8(b, 0xCF)
        _be(b, v, 8)
    return 0


cdef int _bin(Buf *b, const char *s, Py_ssize_t size) except -1:
    _reserve(b, _bin_size(size))
    if size <= 0xFF:
        _u8(b, 0xC4)
        _be(b, size, 1)
    elif size <= 0xFFFF:
        _u8(b, 0xC5)
        _be(b, size, 2)
    else:
        _u8(b, 0xC6)
        _be(b, size, 4)
    memcpy(b.p + b.n, s, size)
    b.n += size
    return 0


cdef int _raw(Buf *b, const char *s, Py_ssize_t size) except -1:
    _reserve(b, size)
    memcpy(b.p + b.n, s, size)
    b.n += size
    return 0


cdef int _array_head(Buf *b, Py_ssize_t n) except -1:
    _reserve(b, _array_head_size(n))
    if n < 16:
        _u8(b, 0x90 | n)
    elif n <= 0xFFFF:
        _u8(b, 0xDC)
        _be(b, n, 2)
    else:
        _u8(b, 0xDD)
        _be(b, n, 4)
    return 0


def group_pack(str name, int n, list end, object records, long long now):
    """The records of one append to topic ``name`` (``n`` partitions; partition ``p`` continues at
    offset ``end[p]``), stamped ``now``: per partition with records, in partition order, ``(p,
    count, tombstones, batch bytes)`` -- the batch is what ``ENCODER.encode`` gives for the partition's ``StoredRow``
    list, uncompressed. None when a record is not the usual kind (see the module docstring).
    ``records``: a list of ``Record``, or the batch's compiled :class:`cdc.logstore._records.Records`
    (read as it is: no object per record)."""
    cdef Py_ssize_t i, m = len(records), nk
    cdef int p
    cdef object r, key, value
    cdef Records recs = None
    cdef Span *sp
    cdef const char **kp = NULL
    cdef const char **vp = NULL
    cdef Py_ssize_t *kl = NULL
    cdef Py_ssize_t *vl = NULL
    cdef int *parts
    cdef Py_ssize_t *counts
    cdef Py_ssize_t *tombs
    cdef Py_ssize_t *written
    cdef Py_ssize_t *sizes
    cdef uint64_t *base
    cdef Buf *bufs
    cdef bytes topic_enc, field, b
    cdef list objs
    cdef uint64_t offset
    cdef Py_ssize_t fixed_size
    if n <= 0 or m == 0 or now < 0:
        return None
    for i in range(n):
        if end[i] < 0:
            return None
    if type(records) is Records:
        recs = <Records>records
        if recs.odd:
            return None
    elif type(records) is not list:
        records = list(records)
    topic_enc = name.encode()
    if PyBytes_GET_SIZE(topic_enc) > 0xFFFF:
        return None
    parts = <int *>malloc(m * sizeof(int))
    counts = <Py_ssize_t *>malloc(n * sizeof(Py_ssize_t))
    tombs = <Py_ssize_t *>malloc(n * sizeof(Py_ssize_t))
    written = <Py_ssize_t *>malloc(n * sizeof(Py_ssize_t))
    sizes = <Py_ssize_t *>malloc(n * sizeof(Py_ssize_t))
    base = <uint64_t *>malloc(n * sizeof(uint64_t))
    bufs = <Buf *>malloc(n * sizeof(Buf))
    kp = <const char **>malloc(m * sizeof(char *))
    vp = <const char **>malloc(m * sizeof(char *))
    kl = <Py_ssize_t *>malloc(m * sizeof(Py_ssize_t))
    vl = <Py_ssize_t *>malloc(m * sizeof(Py_ssize_t))
    try:  # free(NULL) does nothing: the finally frees what was allocated
        if (parts == NULL or counts == NULL or tombs == NULL or written == NULL or bufs == NULL
                or kp == NULL or vp == NULL or kl == NULL or vl == NULL or sizes == NULL or base == NULL):
            raise MemoryError()
        for i in range(n):
            counts[i] = 0
            tombs[i] = 0
            written[i] = 0
            sizes[i] = 0
            base[i] = <uint64_t>end[i]
            bufs[i].p = NULL
            bufs[i].n = 0
            bufs[i].cap = 0
        # the topic's field, the same for every record: 'topic' and its name as msgpack
        nk = PyBytes_GET_SIZE(topic_enc)
        if nk < 32:
            field = b"\x87\xa5topic" + bytes([0xA0 | nk]) + topic_enc + b"\xa9partition"
        elif nk <= 0xFF:
            field = b"\x87\xa5topic\xd9" + bytes([nk]) + topic_enc + b"\xa9partition"
        else:
            field = b"\x87\xa5topic\xda" + int(nk).to_bytes(2, "big") + topic_enc + b"\xa9partition"
        # what every record writes but its partition, offset, key and value
        fixed_size = PyBytes_GET_SIZE(field) + 7 + 4 + 6 + 22 + _uint_size(<uint64_t>now)
        # pass 1: check and place every record (a list's bytes are held by its records)
        for i in range(m):
            if recs is not None:
                sp = &recs.spans[i]
                kp[i] = recs.data + sp.start
                kl[i] = sp.klen
                vp[i] = recs.data + sp.start + sp.klen
                vl[i] = sp.vlen
            else:
                r = (<list>records)[i]
                key = r.key
                value = r.value
                if type(key) is not bytes or (value is not None and type(value) is not bytes):
                    return None
                if r.partition is not None or r.headers or r.timestamp_ms is not None:
                    return None
                kp[i] = PyBytes_AS_STRING(key)
                kl[i] = PyBytes_GET_SIZE(key)
                if value is None:
                    vp[i] = NULL
                    vl[i] = -1
                else:
                    vp[i] = PyBytes_AS_STRING(value)
                    vl[i] = PyBytes_GET_SIZE(value)
            p = (_murmur2(<const unsigned char *>kp[i], kl[i]) & 0x7FFFFFFF) % n
            parts[i] = p
            # its size in the partition's batch, exactly (the batch is written in place)
            sizes[p] += (fixed_size + _uint_size(<uint64_t>p) + _uint_size(base[p] + <uint64_t>counts[p])
                         + _bin_size(kl[i]) + (1 if vl[i] < 0 else _bin_size(vl[i])))
            counts[p] += 1
        # each partition's batch: a bytes object of its exact size, written in place
        objs = [None] * n
        for p in range(n):
            if counts[p]:
                b = PyBytes_FromStringAndSize(NULL, sizes[p] + _array_head_size(counts[p]))
                objs[p] = b
                bufs[p].p = PyBytes_AS_STRING(b)
                bufs[p].cap = PyBytes_GET_SIZE(b)
                _array_head(&bufs[p], counts[p])
        # pass 2: each record into its partition's batch
        for i in range(m):
            p = parts[i]
            offset = base[p] + <uint64_t>written[p]
            written[p] += 1
            _raw(&bufs[p], PyBytes_AS_STRING(field), PyBytes_GET_SIZE(field))
            _uint(&bufs[p], <uint64_t>p)
            _raw(&bufs[p], b"\xa6offset", 7)
            _uint(&bufs[p], offset)
            _raw(&bufs[p], b"\xa3key", 4)
            _bin(&bufs[p], kp[i], kl[i])
            _raw(&bufs[p], b"\xa5value", 6)
            if vl[i] < 0:
                _reserve(&bufs[p], 1)
                _u8(&bufs[p], 0xC0)
                tombs[p] += 1
            else:
                _bin(&bufs[p], vp[i], vl[i])
            _raw(&bufs[p], b"\xa7headers\x90\xactimestamp_ms", 22)
            _uint(&bufs[p], <uint64_t>now)
        out = []
        for p in range(n):
            if counts[p]:
                if bufs[p].n != bufs[p].cap:
                    raise SystemError("group_pack: a partition's batch is shorter than its size computed (a bug)")
                out.append((p, counts[p], tombs[p], objs[p]))
        return out
    finally:
        free(base)
        free(sizes)
        free(kp)
        free(vp)
        free(kl)
        free(vl)
        free(parts)
        free(counts)
        free(tombs)
        free(written)
        free(bufs)
