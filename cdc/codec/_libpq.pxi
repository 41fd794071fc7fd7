# Included by _native.pyx (Changes.pump reads it without a Python object per row change): the
# replication stream's CopyData messages read with libpq itself, from the PGconn of the psycopg2
# connection that started it.
#
# The functions are those of the libpq *psycopg2 loaded* (looked up through its _psycopg module with
# dlopen(RTLD_NOLOAD) + dlsym), never a libpq this module links: psycopg2-binary bundles a libpq of
# its own (17, say, where Debian's is 15), and a PGconn is only valid for the library that made it
# (its struct differs between releases). So nothing here needs libpq-dev, or links -lpq.
#
# The Python reference is psycopg2's ``ReplicationCursor.read_message`` (psycopg/pqpath.c,
# pq_read_replication_message): the same reads (PQgetCopyData async, PQconsumeInput only when
# nothing is buffered), the same keepalive handling (answered when the server asks, with the
# positions psycopg2 holds: what the loop last confirmed through ``send_feedback``); the stream loop
# (cdc.reader.replication) sends the periodic status update psycopg2 sent every ``status_interval``.

cdef extern from "dlfcn.h":
    void *dlopen(const char *filename, int flag)
    void *dlsym(void *handle, const char *symbol)
    char *dlerror()
    int RTLD_NOW
    int RTLD_NOLOAD

cdef extern from *:
    """
    typedef struct pg_conn cdc_PGconn;
    typedef struct pg_result cdc_PGresult;
    typedef int (*cdc_pq_consume_fn)(cdc_PGconn *);
    typedef int (*cdc_pq_getcopy_fn)(cdc_PGconn *, char **, int);
    typedef void (*cdc_pq_free_fn)(void *);
    typedef char *(*cdc_pq_errmsg_fn)(const cdc_PGconn *);
    typedef cdc_PGresult *(*cdc_pq_getresult_fn)(cdc_PGconn *);
    typedef char *(*cdc_pq_resmsg_fn)(const cdc_PGresult *);
    typedef char *(*cdc_pq_field_fn)(const cdc_PGresult *, int);
    typedef void (*cdc_pq_clear_fn)(cdc_PGresult *);
    """
    ctypedef struct cdc_PGconn
    ctypedef struct cdc_PGresult
    ctypedef int (*cdc_pq_consume_fn)(cdc_PGconn *) noexcept nogil
    ctypedef int (*cdc_pq_getcopy_fn)(cdc_PGconn *, char **, int) noexcept nogil
    ctypedef void (*cdc_pq_free_fn)(void *) noexcept nogil
    ctypedef char *(*cdc_pq_errmsg_fn)(const cdc_PGconn *) noexcept nogil
    ctypedef cdc_PGresult *(*cdc_pq_getresult_fn)(cdc_PGconn *) noexcept nogil
    ctypedef char *(*cdc_pq_resmsg_fn)(const cdc_PGresult *) noexcept nogil
    ctypedef char *(*cdc_pq_field_fn)(const cdc_PGresult *, int) noexcept nogil
    ctypedef void (*cdc_pq_clear_fn)(cdc_PGresult *) noexcept nogil

cdef cdc_pq_consume_fn _PQconsumeInput = NULL
cdef cdc_pq_getcopy_fn _PQgetCopyData = NULL
cdef cdc_pq_free_fn _PQfreemem = NULL
cdef cdc_pq_errmsg_fn _PQerrorMessage = NULL
cdef cdc_pq_getresult_fn _PQgetResult = NULL
cdef cdc_pq_resmsg_fn _PQresultErrorMessage = NULL
cdef cdc_pq_field_fn _PQresultErrorField = NULL
cdef cdc_pq_clear_fn _PQclear = NULL
cdef object _libpq_of = None   # the module file the functions were looked up through

#: PG_DIAG_SQLSTATE (postgres_ext.h)
DEF PG_DIAG_SQLSTATE = 67
#: XLogData: 'w', dataStart, walEnd, sendTime, then the payload; keepalive: 'k', walEnd, sendTime, reply
DEF XLOGDATA_HEADER = 25
DEF KEEPALIVE_SIZE = 18


cdef void *_sym(void *handle, const char *name) except NULL:
    cdef void *f = dlsym(handle, name)
    if f == NULL:
        raise ImportError(f"libpq's {name.decode()} is not found through psycopg2's module")
    return f


def libpq_resolve(str module_file):
    """Look libpq's functions up through ``module_file`` (psycopg2's ``_psycopg`` module, already
    loaded: the libpq it uses). ImportError when they cannot be found."""
    global _PQconsumeInput, _PQgetCopyData, _PQfreemem, _PQerrorMessage, _PQgetResult
    global _PQresultErrorMessage, _PQresultErrorField, _PQclear, _libpq_of
    if _libpq_of == module_file:
        return
    cdef bytes path = module_file.encode()
    cdef void *handle = dlopen(path, RTLD_NOW | RTLD_NOLOAD)
    cdef char *err
    if handle == NULL:
        err = dlerror()
        raise ImportError(f"{module_file} is not loaded: {_text(err)}")
    _PQconsumeInput = <cdc_pq_consume_fn>_sym(handle, b"PQconsumeInput")
    _PQgetCopyData = <cdc_pq_getcopy_fn>_sym(handle, b"PQgetCopyData")
    _PQfreemem = <cdc_pq_free_fn>_sym(handle, b"PQfreemem")
    _PQerrorMessage = <cdc_pq_errmsg_fn>_sym(handle, b"PQerrorMessage")
    _PQgetResult = <cdc_pq_getresult_fn>_sym(handle, b"PQgetResult")
    _PQresultErrorMessage = <cdc_pq_resmsg_fn>_sym(handle, b"PQresultErrorMessage")
    _PQresultErrorField = <cdc_pq_field_fn>_sym(handle, b"PQresultErrorField")
    _PQclear = <cdc_pq_clear_fn>_sym(handle, b"PQclear")
    _libpq_of = module_file
    # the handle stays open: psycopg2's module is never unloaded


cdef inline long long _be64(const unsigned char *p) noexcept:
    return <long long>(
        (<unsigned long long>p[0] << 56) | (<unsigned long long>p[1] << 48)
        | (<unsigned long long>p[2] << 40) | (<unsigned long long>p[3] << 32)
        | (<unsigned long long>p[4] << 24) | (<unsigned long long>p[5] << 16)
        | (<unsigned long long>p[6] << 8) | <unsigned long long>p[7]
    )


cdef str _text(const char *s):
    if s == NULL:
        return ""
    return (<bytes>s).decode("utf-8", "replace").strip()


cdef class CopyStream:
    """A started replication stream (psycopg2's connection ``connection``, after
    ``start_replication``) read with libpq: called, it returns the next XLogData as ``raw(payload,
    data_start)`` (what psycopg2's ``read_message`` gives, as the decoders read it) or None when
    nothing is ready; :meth:`Changes.pump` reads it without making that object for the row changes
    it takes. ``wal_end``: the server's position, of the last XLogData or keepalive (psycopg2's
    ``cursor.wal_end``). A keepalive that asks for a reply calls ``on_keepalive()`` (which sends
    the status update); others are taken here. Errors (the connection lost, the server ending the
    stream) raise ``fail(message, sqlstate)`` (the psycopg2 exception the loop's caller handles),
    with libpq's message. Valid while the connection is open: :meth:`close` before closing it."""

    cdef cdc_PGconn *conn
    cdef object connection
    cdef char *buf                       # libpq's copy of the message read last (freed at the next)
    cdef const unsigned char *payload    # the last XLogData's payload, inside ``buf``
    cdef Py_ssize_t size
    cdef public long long data_start
    cdef public long long wal_end
    cdef public long long messages       # XLogData messages read
    cdef public long long keepalives     # keepalives read (``replies``: those that asked for one)
    cdef public long long replies
    cdef public long long direct         # row changes Changes.pump took without an object each
    cdef object on_keepalive
    cdef object raw
    cdef object fail
    cdef object held                     # a message taken back (:meth:`_hold`): the next call's

    def __cinit__(self):
        self.conn = NULL
        self.buf = NULL
        self.payload = NULL
        self.size = 0

    def __init__(self, connection, str libpq_module, on_keepalive, raw, fail):
        """``libpq_module``: the file of the module whose libpq made the connection (psycopg2's
        ``_psycopg``)."""
        libpq_resolve(libpq_module)
        ptr = connection.pgconn_ptr
        if not ptr:
            raise ValueError("the connection is closed")
        self.conn = <cdc_PGconn *><size_t>ptr
        self.connection = connection
        self.on_keepalive = on_keepalive
        self.raw = raw
        self.fail = fail
        self.held = None
        self.data_start = self.wal_end = 0
        self.messages = self.keepalives = self.replies = self.direct = 0

    def __dealloc__(self):
        if self.buf != NULL and _PQfreemem != NULL:
            _PQfreemem(self.buf)

    def close(self):
        """Forget the connection (before it is closed): a call after this raises ``fail``."""
        self._release()
        self.conn = NULL
        self.connection = None
        self.held = None

    cdef inline void _release(self) noexcept:
        if self.buf != NULL:
            _PQfreemem(self.buf)
            self.buf = NULL
            self.payload = NULL

    cdef object _conn_error(self):
        msg = _text(_PQerrorMessage(self.conn)) or "the replication connection failed"
        return self.fail(msg, None)

    cdef object _ended(self):
        """PQgetCopyData's -1: the server ended the COPY; its result says why (an error, or a
        shutdown: psycopg2 then returns None, and raises at the next read)."""
        cdef cdc_PGresult *res = _PQgetResult(self.conn)
        cdef char *st
        msg = sqlstate = None
        if res != NULL:
            msg = _text(_PQresultErrorMessage(res))
            st = _PQresultErrorField(res, PG_DIAG_SQLSTATE)
            sqlstate = _text(st) if st != NULL else None
            _PQclear(res)
        if not msg:
            msg = _text(_PQerrorMessage(self.conn))
        return self.fail(
            f"the server ended the replication stream: {msg}" if msg
            else "the server ended the replication stream (it is shutting down?)",
            sqlstate,
        )

    cdef Py_ssize_t _next(self) except -2:
        """Read the next XLogData (``payload``, its ``size``, ``data_start``): its size, or -1 when
        nothing is ready. Keepalives are taken here."""
        cdef int n
        cdef bint consumed = False
        cdef const unsigned char *b
        if self.conn == NULL:
            raise self.fail("the replication stream was closed", None)
        while True:
            self._release()
            n = _PQgetCopyData(self.conn, &self.buf, 1)
            if n == 0:
                if consumed:
                    return -1
                # only when nothing is buffered (psycopg2's rule: a busy server would otherwise
                # grow libpq's buffer with messages read ahead); a second 0: nothing is ready
                if not _PQconsumeInput(self.conn):
                    raise self._conn_error()
                consumed = True
                continue
            if n == -2:
                raise self._conn_error()
            if n == -1:
                raise self._ended()
            consumed = True
            b = <const unsigned char *>self.buf
            if b[0] == 119:  # w
                if n <= XLOGDATA_HEADER:
                    raise self.fail("data message header too small", None)  # psycopg2's words
                self.data_start = _be64(b + 1)
                self.wal_end = _be64(b + 9)
                self.payload = b + XLOGDATA_HEADER
                self.size = n - XLOGDATA_HEADER
                self.messages += 1
                return self.size
            if b[0] == 107:  # k
                if n < KEEPALIVE_SIZE:
                    raise self.fail("keepalive message header too small", None)
                self.wal_end = _be64(b + 1)
                self.keepalives += 1
                if b[17]:
                    self.replies += 1
                    self._release()
                    self.on_keepalive()
                continue
            kind = chr(b[0])
            raise self.fail(f"unrecognized replication message {kind!r} of {n} bytes", None)

    cdef int _hold(self) except -1:
        """The last XLogData becomes the next call's answer (for the Python path)."""
        self.held = self.raw(PyBytes_FromStringAndSize(<const char *>self.payload, self.size), self.data_start)
        self._release()
        return 0

    def __call__(self):
        cdef Py_ssize_t size
        cdef object held = self.held
        if held is not None:
            self.held = None
            return held
        size = self._next()
        if size < 0:
            return None
        held = self.raw(PyBytes_FromStringAndSize(<const char *>self.payload, size), self.data_start)
        self._release()
        return held

    def skim(self, long long budget):
        """Read up to ``budget`` messages and drop them (a benchmark's floor: the read alone):
        (messages, payload bytes, the last ``data_start``); fewer when nothing is ready."""
        cdef long long k = 0, size = 0
        cdef Py_ssize_t got
        while k < budget:
            got = self._next()
            if got < 0:
                break
            k += 1
            size += got
        self._release()
        return k, size, self.data_start
