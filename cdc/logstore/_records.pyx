# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""A batch's records for one topic in C (issue #34): each record's key and value bytes in one
buffer, no ``Record`` object per record. The compiled per-change path (:mod:`cdc.codec._native`,
``Changes.pump``) writes each change's key and value straight into it; the embedded store's compiled
append (:mod:`cdc.logstore.embedded._pack`) reads it as is.

To everyone else it is a ``Sequence[Record]`` (:class:`cdc.logstore.Record`): ``len``, indexing and
iteration give ``Record`` objects equal to the ones added (built on demand), so the Kafka store and
the embedded store's reference path take it as they take a list -- one form of a batch. A record
that is not the usual kind (a key that is not ``bytes``, a value neither ``bytes`` nor None, a
partition, headers or a timestamp) is kept as it was given, and the compiled append declines the
batch (its reference path names what is wrong). The Python reference of this class is a plain
``list`` (:func:`cdc.logstore.batch.records_form`); ``tests/logstore/test_pack.py`` holds the two
equal.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdlib cimport free, realloc
from libc.string cimport memcpy

from cdc.logstore import Record

#: what cdc.logstore.batch expects of this module
ABI = 1

cdef object _Record = Record


cdef class Records:
    """Records to append to one topic (see the module docstring)."""

    def __cinit__(self):
        self.data = NULL
        self.size = 0
        self.cap = 0
        self.spans = NULL
        self.count = 0
        self.scap = 0
        self.odd = None

    def __init__(self, records=()):
        self.extend(records)

    def __dealloc__(self):
        free(self.data)
        free(self.spans)

    cdef int _room(self, Py_ssize_t more) except -1:
        cdef Py_ssize_t cap = self.cap
        cdef char *p
        cdef Span *s
        if self.size + more > cap:
            while cap < self.size + more:
                cap = cap * 2 if cap else 65536
            p = <char *>realloc(self.data, cap)
            if p == NULL:
                raise MemoryError()
            self.data = p
            self.cap = cap
        if self.count >= self.scap:
            cap = self.scap * 2 if self.scap else 1024
            s = <Span *>realloc(self.spans, cap * sizeof(Span))
            if s == NULL:
                raise MemoryError()
            self.spans = s
            self.scap = cap
        return 0

    cdef int put(self, const char *key, Py_ssize_t klen, const char *value, Py_ssize_t vlen) except -1:
        """A usual record: ``key``, and ``value`` (``vlen`` -1: a tombstone), copied in."""
        cdef Span *s
        self._room(klen + (vlen if vlen > 0 else 0))
        s = &self.spans[self.count]
        s.start = self.size
        s.klen = klen
        s.vlen = vlen
        if klen > 0:
            memcpy(self.data + self.size, key, klen)
            self.size += klen
        if vlen > 0:
            memcpy(self.data + self.size, value, vlen)
            self.size += vlen
        self.count += 1
        return 0

    cdef int add(self, object record) except -1:
        cdef object key = record.key, value = record.value
        if (
            type(key) is bytes
            and (value is None or type(value) is bytes)
            and record.partition is None
            and record.timestamp_ms is None
            and not record.headers
        ):
            if value is None:
                return self.put(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key), NULL, -1)
            return self.put(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key), PyBytes_AS_STRING(value),
                            PyBytes_GET_SIZE(value))
        if self.odd is None:
            self.odd = {}
        self.odd[self.count] = record
        return self.put(NULL, 0, NULL, -1)

    def append(self, record):
        """Add ``record`` (a :class:`cdc.logstore.Record`) at the end."""
        self.add(record)

    def extend(self, records):
        """Add each of ``records`` at the end."""
        cdef Records other
        cdef Py_ssize_t i
        if type(records) is Records and records is not self:
            other = <Records>records
            for i in range(other.count):
                if other.odd is not None and i in other.odd:
                    self.add(other.odd[i])
                else:
                    self.put(other.data + other.spans[i].start, other.spans[i].klen,
                             other.data + other.spans[i].start + other.spans[i].klen, other.spans[i].vlen)
            return
        for r in (list(records) if records is self else records):
            self.add(r)

    @property
    def usual(self):
        """Whether every record is the usual kind (the compiled append takes the batch)."""
        return not self.odd

    def __len__(self):
        return self.count

    cdef object _get(self, Py_ssize_t i):
        cdef Span *s = &self.spans[i]
        cdef object key
        if self.odd is not None:
            r = self.odd.get(i)
            if r is not None:
                return r
        key = PyBytes_FromStringAndSize(self.data + s.start, s.klen)
        if s.vlen < 0:
            return _Record(key, None)
        return _Record(key, PyBytes_FromStringAndSize(self.data + s.start + s.klen, s.vlen))

    def __getitem__(self, index):
        cdef Py_ssize_t i
        if isinstance(index, slice):
            return [self._get(i) for i in range(*index.indices(self.count))]
        i = index
        if i < 0:
            i += self.count
        if i < 0 or i >= self.count:
            raise IndexError("Records index out of range")
        return self._get(i)

    def __iter__(self):
        cdef Py_ssize_t i
        for i in range(self.count):
            yield self._get(i)

    def __repr__(self):
        return f"Records({self.count} records, {self.size} bytes)"
