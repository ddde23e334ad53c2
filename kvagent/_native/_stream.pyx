# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled twin of kvagent/stream/apply.py's ``run_ops_python`` (issue #36): a stream entry's event columns
applied to the replica index's stores in one loop, with no RouterEvent (nor Stored/Removed) per event.

It stores and removes the blocks of the events from ``position`` up to the next Cleared (or the end) through
each store's own ``store``/``remove``, exactly as the Python loop does, and returns where it stopped with the
column offsets there.  The decoder checked the columns against the counts; every slice is checked again here
(an IndexError, not a read past a buffer). tests/unit/test_stream_apply.py pins it to the Python loop.
"""

from cpython.long cimport PyLong_FromUnsignedLongLong
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM

cdef enum:
    KIND_STORED_CHILD = 1
    KIND_REMOVED = 2
    KIND_CLEARED = 3


cdef inline tuple u64_tuple(const unsigned long long[:] column, Py_ssize_t start, Py_ssize_t count):
    cdef tuple result = PyTuple_New(count)
    cdef Py_ssize_t index
    cdef object value
    for index in range(count):
        value = PyLong_FromUnsignedLongLong(column[start + index])
        Py_INCREF(value)  # PyTuple_SET_ITEM steals the reference
        PyTuple_SET_ITEM(result, index, value)
    return result


def run_ops(
    list stores,
    const unsigned char[:] kinds,
    const unsigned short[:] codes,
    const unsigned int[:] counts,
    const unsigned long long[:] hashes,
    const unsigned long long[:] tokens,
    const unsigned long long[:] parents,
    dict extras,
    Py_ssize_t position,
    tuple offsets,
):
    cdef Py_ssize_t at = offsets[0], stored_at = offsets[1], parent_at = offsets[2]
    cdef Py_ssize_t end = kinds.shape[0], count, code
    cdef unsigned char kind
    cdef object store, parent, infos, extra
    if codes.shape[0] != end or counts.shape[0] != end or position < 0:
        raise ValueError("entry columns of different lengths")
    while position < end:
        kind = kinds[position]
        if kind == KIND_CLEARED:
            break
        count = counts[position]
        code = codes[position]
        if code >= len(stores) or at + count > hashes.shape[0]:
            raise IndexError("entry columns shorter than their counts")
        store = stores[code]
        if kind == KIND_REMOVED:
            store.remove(u64_tuple(hashes, at, count))
        else:
            if stored_at + count > tokens.shape[0]:
                raise IndexError("entry tokens column shorter than its counts")
            parent = None
            if kind == KIND_STORED_CHILD:
                if parent_at >= parents.shape[0]:
                    raise IndexError("entry parents column shorter than its Stored children")
                parent = PyLong_FromUnsignedLongLong(parents[parent_at])
                parent_at += 1
            infos = None
            if extras:
                extra = extras.get(position)
                if extra is not None:
                    infos = extra[1]
            store.store(parent, u64_tuple(hashes, at, count), u64_tuple(tokens, stored_at, count), infos)
            stored_at += count
        at += count
        position += 1
    return position, (at, stored_at, parent_at)
