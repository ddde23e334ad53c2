# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled twin of kvagent/recovery/wire_columns.py (issue #25): the same functions, the same bytes.

Each encoder sizes its output in a first pass, grows ``out`` once and writes every event with memcpy and
byte swaps; ``ends`` grows once too.  kvagent.recovery.wire_columns imports this module when it was built
and falls back to its own pure-Python encoders otherwise; tests/unit/test_wire_columns.py runs both and
compares them byte for byte.
"""

from cpython cimport array
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE, PyByteArray_Resize
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy

import array as py_array

cdef enum:
    KIND_STORED_CHILD = 1
    KIND_REMOVED = 2
    KIND_CLEARED = 3


cdef inline char* put(char* at, const char* data, Py_ssize_t size) noexcept nogil:
    memcpy(at, data, size)
    return at + size


cdef inline char* put_u64(char* at, uint64_t value) noexcept nogil:
    cdef int shift
    for shift in range(8):
        at[shift] = <char>((value >> (56 - 8 * shift)) & 0xFF)
    return at + 8


cdef inline Py_ssize_t array_header_size(Py_ssize_t count) noexcept nogil:
    if count < 16:
        return 1
    if count < 65536:
        return 3
    return 5


cdef inline char* put_array_header(char* at, Py_ssize_t count) noexcept nogil:
    if count < 16:
        at[0] = <char>(0x90 | count)
        return at + 1
    if count < 65536:
        at[0] = <char>0xDC
        at[1] = <char>((count >> 8) & 0xFF)
        at[2] = <char>(count & 0xFF)
        return at + 3
    at[0] = <char>0xDD
    at[1] = <char>((count >> 24) & 0xFF)
    at[2] = <char>((count >> 16) & 0xFF)
    at[3] = <char>((count >> 8) & 0xFF)
    at[4] = <char>(count & 0xFF)
    return at + 5


cdef inline Py_ssize_t decimal_size(uint64_t value) noexcept nogil:
    cdef Py_ssize_t size = 1
    while value >= 10:
        value //= 10
        size += 1
    return size


cdef inline char* put_decimal(char* at, uint64_t value) noexcept nogil:
    cdef Py_ssize_t size = decimal_size(value)
    cdef Py_ssize_t index = size - 1
    while True:
        at[index] = <char>(48 + value % 10)
        value //= 10
        if index == 0:
            break
        index -= 1
    return at + size


cdef char* grow(bytearray out, Py_ssize_t extra) except NULL:
    """Grow ``out`` by ``extra`` bytes; the start of the new room."""
    cdef Py_ssize_t size = PyByteArray_GET_SIZE(out)
    PyByteArray_Resize(out, size + extra)
    return PyByteArray_AS_STRING(out) + size


cdef uint32_t* grow_ends(array.array ends, Py_ssize_t extra) except NULL:
    cdef Py_ssize_t size = len(ends)
    array.resize(ends, size + extra)
    return ends.data.as_uints + size


def encode_ring_events(
    bytearray out,
    array.array ends,
    list heads,
    list tails,
    object templates,
    const uint64_t[:] ids,
    const uint16_t[:] routes,
    const uint8_t[:] kinds,
    const uint64_t[:] parents,
    const uint32_t[:] offsets,
    const uint64_t[:] hashes,
    const uint64_t[:] tokens,
    Py_ssize_t first,
    Py_ssize_t end,
):
    cdef bytes stored_head = templates[0], stored_blocks = templates[1], block_head = templates[2]
    cdef bytes block_mid = templates[3], block_tail = templates[4], removed_head = templates[5]
    cdef bytes cleared = templates[6]
    cdef Py_ssize_t block_size = len(block_head) + 8 + len(block_mid) + 8 + len(block_tail)
    cdef Py_ssize_t total = 0, position, count, size
    cdef uint8_t kind
    cdef bytes head, tail
    if end <= first:
        return
    if ends.typecode != "I":
        raise TypeError("ends must be an array('I')")
    for position in range(first, end):
        kind = kinds[position]
        size = len(<bytes>heads[routes[position]]) + 8 + len(<bytes>tails[routes[position]])
        if kind == KIND_CLEARED:
            size += len(cleared)
        else:
            count = offsets[position + 1] - offsets[position]
            if kind == KIND_REMOVED:
                size += len(removed_head) + array_header_size(count) + 9 * count
            else:
                size += len(stored_head) + (9 if kind == KIND_STORED_CHILD else 1)
                size += len(stored_blocks) + array_header_size(count) + block_size * count
        total += size
    cdef Py_ssize_t base = PyByteArray_GET_SIZE(out)
    cdef char* start = grow(out, total)
    cdef char* at = start
    cdef uint32_t* end_at = grow_ends(ends, end - first)
    cdef const char* c_stored_head = stored_head
    cdef const char* c_stored_blocks = stored_blocks
    cdef const char* c_block_head = block_head
    cdef const char* c_block_mid = block_mid
    cdef const char* c_block_tail = block_tail
    cdef const char* c_removed_head = removed_head
    cdef Py_ssize_t n_stored_head = len(stored_head), n_stored_blocks = len(stored_blocks)
    cdef Py_ssize_t n_block_head = len(block_head), n_block_mid = len(block_mid), n_block_tail = len(block_tail)
    cdef Py_ssize_t n_removed_head = len(removed_head)
    cdef uint32_t lo, hi, block
    for position in range(first, end):
        head = <bytes>heads[routes[position]]
        tail = <bytes>tails[routes[position]]
        at = put(at, head, len(head))
        at = put_u64(at, ids[position])
        kind = kinds[position]
        if kind == KIND_CLEARED:
            at = put(at, cleared, len(cleared))
        else:
            lo = offsets[position]
            hi = offsets[position + 1]
            if kind == KIND_REMOVED:
                at = put(at, c_removed_head, n_removed_head)
                at = put_array_header(at, hi - lo)
                for block in range(lo, hi):
                    at[0] = <char>0xCF
                    at = put_u64(at + 1, hashes[block])
            else:
                at = put(at, c_stored_head, n_stored_head)
                if kind == KIND_STORED_CHILD:
                    at[0] = <char>0xCF
                    at = put_u64(at + 1, parents[position])
                else:
                    at[0] = <char>0xC0
                    at += 1
                at = put(at, c_stored_blocks, n_stored_blocks)
                at = put_array_header(at, hi - lo)
                for block in range(lo, hi):
                    at = put(at, c_block_head, n_block_head)
                    at = put_u64(at, hashes[block])
                    at = put(at, c_block_mid, n_block_mid)
                    at = put_u64(at, tokens[block])
                    at = put(at, c_block_tail, n_block_tail)
        at = put(at, tail, len(tail))
        end_at[0] = <uint32_t>(base + (at - start))
        end_at += 1


def encode_dump_msgpack(
    bytearray out,
    array.array ends,
    object template,
    const uint64_t[:] hashes,
    const uint64_t[:] parents,
    const uint64_t[:] tokens,
    const uint8_t[:] flags,
    Py_ssize_t first,
    Py_ssize_t end,
    uint64_t event_id,
):
    cdef bytes head = template[0], mid = template[1], blocks = template[2], key = template[3]
    cdef bytes tail = template[4], root_mid = template[5]
    cdef Py_ssize_t n_head = len(head), n_mid = len(mid), n_blocks = len(blocks), n_key = len(key)
    cdef Py_ssize_t n_tail = len(tail), n_root_mid = len(root_mid)
    cdef Py_ssize_t with_parent = n_head + 8 + n_mid + 8 + n_blocks + 8 + n_key + 8 + n_tail
    cdef Py_ssize_t as_root = n_head + 8 + n_root_mid + 8 + n_key + 8 + n_tail
    cdef Py_ssize_t row, parents_count = 0, roots = 0
    if ends.typecode != "I":
        raise TypeError("ends must be an array('I')")
    for row in range(first, end):
        if flags[row] == 1:
            parents_count += 1
        elif flags[row] == 0:
            roots += 1
    if parents_count + roots == 0:
        return event_id
    cdef Py_ssize_t base = PyByteArray_GET_SIZE(out)
    cdef char* start = grow(out, parents_count * with_parent + roots * as_root)
    cdef char* at = start
    cdef uint32_t* end_at = grow_ends(ends, parents_count + roots)
    cdef const char* c_head = head
    cdef const char* c_mid = mid
    cdef const char* c_blocks = blocks
    cdef const char* c_key = key
    cdef const char* c_tail = tail
    cdef const char* c_root_mid = root_mid
    with nogil:
        for row in range(first, end):
            if flags[row] > 1:
                continue
            at = put(at, c_head, n_head)
            at = put_u64(at, event_id)
            if flags[row] == 1:
                at = put(at, c_mid, n_mid)
                at = put_u64(at, parents[row])
                at = put(at, c_blocks, n_blocks)
            else:
                at = put(at, c_root_mid, n_root_mid)
            at = put_u64(at, hashes[row])
            at = put(at, c_key, n_key)
            at = put_u64(at, tokens[row])
            at = put(at, c_tail, n_tail)
            end_at[0] = <uint32_t>(base + (at - start))
            end_at += 1
            event_id += 1
    return event_id


def encode_dump_json(
    bytearray out,
    array.array ends,
    object template,
    const uint64_t[:] hashes,
    const uint64_t[:] parents,
    const uint64_t[:] tokens,
    const uint8_t[:] flags,
    Py_ssize_t first,
    Py_ssize_t end,
    uint64_t event_id,
):
    cdef bytes p0 = template[0], p1 = template[1], p2 = template[2], p3 = template[3], p4 = template[4]
    cdef Py_ssize_t n0 = len(p0), n1 = len(p1), n2 = len(p2), n3 = len(p3), n4 = len(p4)
    cdef Py_ssize_t row, total = 0, events = 0
    cdef uint64_t next_id = event_id
    if ends.typecode != "I":
        raise TypeError("ends must be an array('I')")
    cdef Py_ssize_t base = PyByteArray_GET_SIZE(out)
    cdef bint comma = base > 0
    for row in range(first, end):
        if flags[row] > 1:
            continue
        total += n0 + decimal_size(next_id) + n1 + n2 + decimal_size(hashes[row]) + n3
        total += decimal_size(tokens[row]) + n4
        total += decimal_size(parents[row]) if flags[row] == 1 else 4
        if comma or events:
            total += 1
        events += 1
        next_id += 1
    if events == 0:
        return event_id
    cdef char* start = grow(out, total)
    cdef char* at = start
    cdef uint32_t* end_at = grow_ends(ends, events)
    cdef const char* c0 = p0
    cdef const char* c1 = p1
    cdef const char* c2 = p2
    cdef const char* c3 = p3
    cdef const char* c4 = p4
    with nogil:
        for row in range(first, end):
            if flags[row] > 1:
                continue
            if comma:
                at[0] = <char>44
                at += 1
            comma = True
            at = put(at, c0, n0)
            at = put_decimal(at, event_id)
            at = put(at, c1, n1)
            if flags[row] == 1:
                at = put_decimal(at, parents[row])
            else:
                at = put(at, "null", 4)
            at = put(at, c2, n2)
            at = put_decimal(at, hashes[row])
            at = put(at, c3, n3)
            at = put_decimal(at, tokens[row])
            at = put(at, c4, n4)
            end_at[0] = <uint32_t>(base + (at - start))
            end_at += 1
            event_id += 1
    return event_id


def parents_first(
    const uint64_t[:] hashes,
    const uint64_t[:] parents,
    const uint8_t[:] flags,
    dict slots,
    Py_ssize_t span,
):
    """kvagent.index.store.BlockStore.rows_parent_first over its columns: True when every row with a
    resident parent (flag 1) sits after its parent's row.  ``slots`` maps a resident hash to its base row;
    the parent's row is at most ``span - 1`` rows after its base (dead rows, flag 2, are skipped)."""
    cdef Py_ssize_t rows = flags.shape[0], row, base, probe, last
    cdef uint64_t parent
    cdef object found
    for row in range(rows):
        if flags[row] != 1:
            continue
        parent = parents[row]
        if row > 0 and flags[row - 1] != 2 and hashes[row - 1] == parent:
            continue  # the chain stored in one go: the parent is the previous row
        found = slots.get(parent)
        if found is None:
            continue  # not resident
        base = found
        if base + span - 1 < row:
            continue  # every row the parent can be in is earlier
        last = min(base + span, rows)
        for probe in range(base, last):
            if hashes[probe] == parent and flags[probe] != 2:
                if probe >= row:
                    return False
                break
    return True


# --- the ring's append (kvagent/index/ring.py: RingSegment.append, the same columns) -----------------------

from cpython.array cimport resize_smart
from cpython.bytearray cimport PyByteArray_AS_STRING
from cpython.long cimport PyLong_AsUnsignedLongLong
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE

from kvagent.model.events import Removed as _Removed, Stored as _Stored


cdef inline void push_u64(array.array column, uint64_t value) except *:
    cdef Py_ssize_t size = len(column)
    resize_smart(column, size + 1)
    column.data.as_ulonglongs[size] = value


cdef inline void push_u64s(array.array column, tuple values) except *:
    cdef Py_ssize_t size = len(column), count = PyTuple_GET_SIZE(values), index
    resize_smart(column, size + count)
    for index in range(count):
        column.data.as_ulonglongs[size + index] = PyLong_AsUnsignedLongLong(<object>PyTuple_GET_ITEM(values, index))


cdef inline void push_zeros(array.array column, Py_ssize_t count) except *:
    cdef Py_ssize_t size = len(column), index
    resize_smart(column, size + count)
    for index in range(count):
        column.data.as_ulonglongs[size + index] = 0


cdef inline void push_byte(bytearray column, uint8_t value) except *:
    cdef Py_ssize_t size = PyByteArray_GET_SIZE(column)
    PyByteArray_Resize(column, size + 1)
    PyByteArray_AS_STRING(column)[size] = <char>value


def ring_append(object segment, object event):
    """RingSegment.append(event) in one compiled step (the columns and the route table of ring.py)."""
    cdef object source = event.state_source
    cdef tuple key = (event.worker_id, event.storage_tier, event.residency_domain, event.dp_rank, id(source),
                      event.session_id)
    cdef dict codes = segment.route_codes
    code = codes.get(key)
    if code is None:
        code = segment.add_route(event, key)
    cdef array.array ids = segment.ids, routes = segment.routes, parents = segment.parents
    cdef array.array offsets = segment.offsets, hashes = segment.hashes, tokens = segment.tokens
    cdef bytearray kinds = segment.kinds
    cdef object data = event.data
    cdef object cls = type(data)
    cdef object parent
    cdef tuple block_hashes
    cdef Py_ssize_t size, position = len(ids)
    if cls is _Stored:
        parent = data.parent_hash
        if parent is None:
            push_byte(kinds, 0)
            push_u64(parents, 0)
        else:
            push_byte(kinds, 1)
            push_u64(parents, PyLong_AsUnsignedLongLong(parent))
        push_u64s(hashes, data.block_hashes)
        push_u64s(tokens, data.tokens_hashes)
        if data.mm_extra_infos is not None or data.start_position is not None:
            segment.extras[position] = (data.start_position, data.mm_extra_infos)
    elif cls is _Removed:
        push_byte(kinds, 2)
        push_u64(parents, 0)
        block_hashes = data.block_hashes
        push_u64s(hashes, block_hashes)
        push_zeros(tokens, PyTuple_GET_SIZE(block_hashes))
    else:
        push_byte(kinds, 3)
        push_u64(parents, 0)
    push_u64(ids, PyLong_AsUnsignedLongLong(event.event_id))
    size = len(routes)
    resize_smart(routes, size + 1)
    routes.data.as_ushorts[size] = <uint16_t>code
    size = len(offsets)
    resize_smart(offsets, size + 1)
    offsets.data.as_uints[size] = <uint32_t>len(hashes)


# --- the persistence writer's suffix batch rows (kvagent/persist/columns.py's encode_ring_batch) ---------


cdef inline Py_ssize_t uint_size(uint64_t value) noexcept nogil:
    if value < 128:
        return 1
    if value < 256:
        return 2
    if value < 65536:
        return 3
    if value <= <uint64_t>0xFFFFFFFFU:
        return 5
    return 9


cdef inline char* put_uint(char* at, uint64_t value) noexcept nogil:
    """``value`` as msgpack-python packs a non-negative int: the smallest of its unsigned forms."""
    if value < 128:
        at[0] = <char>value
        return at + 1
    if value < 256:
        at[0] = <char>0xCC
        at[1] = <char>value
        return at + 2
    if value < 65536:
        at[0] = <char>0xCD
        at[1] = <char>(value >> 8)
        at[2] = <char>(value & 0xFF)
        return at + 3
    if value <= <uint64_t>0xFFFFFFFFU:
        at[0] = <char>0xCE
        at[1] = <char>(value >> 24)
        at[2] = <char>((value >> 16) & 0xFF)
        at[3] = <char>((value >> 8) & 0xFF)
        at[4] = <char>(value & 0xFF)
        return at + 5
    at[0] = <char>0xCF
    return put_u64(at + 1, value)


def encode_batch_rows(
    bytearray out,
    const uint32_t[:] route_map,
    const uint64_t[:] ids,
    const uint16_t[:] routes,
    const uint8_t[:] kinds,
    const uint64_t[:] parents,
    const uint32_t[:] offsets,
    const uint64_t[:] hashes,
    const uint64_t[:] tokens,
    Py_ssize_t first,
    Py_ssize_t end,
):
    """Append the msgpack rows of ``codec.encode_batch`` (tokens left out) for events first..end of a ring
    segment with no extras (start position, multimodal info); ``route_map[code]`` is the batch's route index."""
    cdef Py_ssize_t total = 0, position, count, block
    cdef uint8_t kind
    cdef uint32_t lo, hi
    for position in range(first, end):
        kind = kinds[position]
        total += 2 + uint_size(ids[position]) + uint_size(route_map[routes[position]])
        if kind == KIND_CLEARED:
            continue
        lo, hi = offsets[position], offsets[position + 1]
        count = hi - lo
        total += array_header_size(count)
        for block in range(lo, hi):
            total += uint_size(hashes[block])
        if kind != KIND_REMOVED:
            total += (uint_size(parents[position]) if kind == KIND_STORED_CHILD else 1) + 3
            total += array_header_size(count)
            for block in range(lo, hi):
                total += uint_size(tokens[block])
    cdef char* at = grow(out, total)
    for position in range(first, end):
        kind = kinds[position]
        if kind == KIND_CLEARED:
            at[0] = <char>0x93
        elif kind == KIND_REMOVED:
            at[0] = <char>0x94
        else:
            at[0] = <char>0x99
        at = put_uint(at + 1, ids[position])
        at = put_uint(at, route_map[routes[position]])
        if kind == KIND_CLEARED:
            at[0] = <char>2
            at += 1
            continue
        lo, hi = offsets[position], offsets[position + 1]
        if kind == KIND_REMOVED:
            at[0] = <char>1
            at = put_array_header(at + 1, hi - lo)
            for block in range(lo, hi):
                at = put_uint(at, hashes[block])
            continue
        at[0] = <char>0
        at += 1
        if kind == KIND_STORED_CHILD:
            at = put_uint(at, parents[position])
        else:
            at[0] = <char>0xC0
            at += 1
        at = put_array_header(at, hi - lo)
        for block in range(lo, hi):
            at = put_uint(at, hashes[block])
        at = put_array_header(at, hi - lo)
        for block in range(lo, hi):
            at = put_uint(at, tokens[block])
        at[0] = <char>0xC0  # token bytes left out
        at[1] = <char>0xC0  # start position
        at[2] = <char>0xC0  # multimodal info
        at += 3
