# The compiled form of a batch's records for one topic (cdc/logstore/_records.pyx), cimported by the
# per-change path (cdc.codec._native), which fills it, and the embedded store's append
# (cdc.logstore.embedded._pack), which reads it.

cdef struct Span:
    Py_ssize_t start   # the key's first byte in ``data``; the value follows the key
    Py_ssize_t klen
    Py_ssize_t vlen    # -1: a tombstone (value None)


cdef class Records:
    cdef char *data
    cdef Py_ssize_t size
    cdef Py_ssize_t cap
    cdef Span *spans
    cdef Py_ssize_t count
    cdef Py_ssize_t scap
    cdef dict odd      # index -> Record: a record not of the usual kind (kept as it was given)

    cdef int _room(self, Py_ssize_t more) except -1
    cdef object _get(self, Py_ssize_t i)
    cdef int put(self, const char *key, Py_ssize_t klen, const char *value, Py_ssize_t vlen) except -1
    cdef int add(self, object record) except -1
