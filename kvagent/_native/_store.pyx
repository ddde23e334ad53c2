# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled twin of kvagent/index/store.py's ``BlockStore`` and of ``RecoveryIndex.apply_run`` (issue #25).

``BlockTable`` keeps the same rows as the Python store (row order is insertion order, a removed block's row
is zeroed and flagged dead, the same incremental compaction moves the same rows at the same calls), so
every observable (``columns()``, ``replay_order()``, the dump) is identical; what differs is the map from a
block hash to its row. Instead of a Python dict with an int object per block it is an open-addressing table
of 8-byte slots: the row (plus one, 0 marks an empty slot) in the low half and a 32-bit fingerprint of the
hash in the high half. The fingerprint's top bits are also the slot the hash starts probing at, so deleting
(backward shift) and growing never read the hash columns; a lookup compares the hash column only on a
fingerprint match. The columns are plain C buffers.

About 8-16 bytes of table plus 25 bytes of columns per block, against the dict's 60-90 bytes.

``apply_run`` is the loop of ``RecoveryIndex.apply_run`` over such stores in one compiled pass; it declines
(None, nothing changed) whatever is not of the plain shape, and the Python method then decides.
tests/unit/test_native_store.py pins both to the Python versions.
"""

from cpython cimport array
from cpython.array cimport resize_smart
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_Clear, PyErr_Occurred
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.long cimport PyLong_AsUnsignedLongLong
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from cpython.object cimport PyObject, Py_SIZE
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memchr, memcpy, memmove, memset

import array as py_array
import os

cdef enum:
    FLAG_ROOT = 0
    FLAG_PARENT = 1
    FLAG_DEAD = 2

DEF MIN_BITS = 3
# Rows are stored plus one in 32 bits.
DEF MAX_ROWS = 4294967294

# A per-process seed: the block hashes come from outside, so their slots must not be predictable.
cdef uint64_t SEED = int.from_bytes(os.urandom(8), "little")
cdef object _ARRAY = py_array.array


cdef inline uint64_t mix(uint64_t value) noexcept nogil:
    # splitmix64's finalizer: every input bit moves every output bit.
    value ^= SEED
    value = (value ^ (value >> 30)) * 0xbf58476d1ce4e5b9ULL
    value = (value ^ (value >> 27)) * 0x94d049bb133111ebULL
    return value ^ (value >> 31)


cdef inline bint as_u64(object value, uint64_t* out):
    """The exact int ``value`` as a u64; False (no error set) for any other type or an int out of range."""
    if type(value) is not int:
        return False
    cdef uint64_t result
    try:
        result = PyLong_AsUnsignedLongLong(value)
    except OverflowError:
        return False
    out[0] = result
    return True


cdef bint key_of(object value, uint64_t* out) except -1:
    """A lookup key the way a dict of int keys sees ``value``: an int (bool included) or an integral float
    in u64 range is that key; anything else hashable is no key (False); an unhashable value raises."""
    if isinstance(value, int):
        if as_u64(int(value), out):
            return True
        return False
    if type(value) is float:
        if value.is_integer() and 0 <= value <= 18446744073709551615:
            return as_u64(int(value), out)
        return False
    hash(value)  # a dict raises TypeError for an unhashable key
    return False


cdef class Scratch:
    """A growable u64 buffer for converting a tuple of hashes once, before anything changes."""
    cdef uint64_t* data
    cdef Py_ssize_t capacity

    cdef uint64_t* reserve(self, Py_ssize_t count) except NULL:
        cdef uint64_t* grown
        if count > self.capacity:
            grown = <uint64_t*>realloc(self.data, (count + 64) * 8)
            if grown == NULL:
                raise MemoryError()
            self.data, self.capacity = grown, count + 64
        if self.data == NULL:
            self.data = <uint64_t*>malloc(64 * 8)
            if self.data == NULL:
                raise MemoryError()
            self.capacity = 64
        return self.data

    def __dealloc__(self):
        free(self.data)




cdef bint tuple_u64s(tuple values, uint64_t* out):
    """Every item of ``values`` as a u64 in ``out``; False when one is not an exact int in range."""
    cdef Py_ssize_t index, count = PyTuple_GET_SIZE(values)
    for index in range(count):
        if not as_u64(<object>PyTuple_GET_ITEM(values, index), out + index):
            return False
    return True


cdef int loose_u64s(tuple values, uint64_t* out) except -1:
    """Every item as a u64 the way ``array('Q')`` takes it (any int, bool included), raising otherwise."""
    cdef Py_ssize_t index
    cdef object value
    for index in range(PyTuple_GET_SIZE(values)):
        value = <object>PyTuple_GET_ITEM(values, index)
        if not isinstance(value, int):
            raise TypeError(f"a block hash must be an int, not {type(value).__name__}")
        out[index] = PyLong_AsUnsignedLongLong(int(value))
    return 0


cdef class BlockTable:
    """kvagent.index.store.BlockStore's storage and semantics with a C hash table (see the module docstring).

    ``min_free`` and ``step_rows`` are the Python store's ``_COMPACT_MIN_FREE`` and ``_COMPACT_STEP_ROWS``.
    """

    cdef uint64_t* table
    cdef int bits
    cdef Py_ssize_t count
    cdef uint64_t* hash_col
    cdef uint64_t* parent_col
    cdef uint64_t* token_col
    cdef uint8_t* flag_col
    cdef Py_ssize_t rows, row_capacity, dead, compact_read, compact_write
    cdef readonly Py_ssize_t min_free, step_rows
    cdef dict mm
    cdef Py_ssize_t* moved  # table slots of the rows one compaction step moves
    cdef Py_ssize_t version  # bumped by every change (hashes() refuses to go on across one)

    def __cinit__(self, Py_ssize_t min_free=4096, Py_ssize_t step_rows=256):
        if step_rows <= 0:
            raise ValueError("step_rows must be positive")
        self.min_free, self.step_rows = min_free, step_rows
        self.mm = {}
        self.compact_read = self.compact_write = -1
        self.moved = <Py_ssize_t*>malloc(step_rows * sizeof(Py_ssize_t))
        if self.moved == NULL:
            raise MemoryError()

    def __dealloc__(self):
        self.release()
        free(self.moved)

    cdef void release(self) noexcept:
        free(self.table)
        free(self.hash_col)
        free(self.parent_col)
        free(self.token_col)
        free(self.flag_col)
        self.table = NULL
        self.hash_col = self.parent_col = self.token_col = NULL
        self.flag_col = NULL
        self.bits = 0
        self.count = self.rows = self.row_capacity = self.dead = 0

    # --- the hash table ---------------------------------------------------------------------------------

    cdef inline Py_ssize_t find_slot(self, uint64_t key) noexcept:
        """The table slot holding ``key``, or -1."""
        if self.table == NULL:
            return -1
        cdef uint64_t mixed = mix(key)
        cdef uint64_t fingerprint = mixed >> 32
        cdef uint64_t mask = (<uint64_t>1 << self.bits) - 1
        cdef uint64_t at = fingerprint >> (32 - self.bits)
        cdef uint64_t entry
        while True:
            entry = self.table[at]
            if entry == 0:
                return -1
            if (entry >> 32) == fingerprint and self.hash_col[(entry & 0xFFFFFFFFULL) - 1] == key:
                return <Py_ssize_t>at
            at = (at + 1) & mask

    cdef inline Py_ssize_t find(self, uint64_t key) noexcept:
        """The row of ``key``, or -1."""
        cdef Py_ssize_t slot = self.find_slot(key)
        if slot < 0:
            return -1
        return <Py_ssize_t>((self.table[slot] & 0xFFFFFFFFULL) - 1)

    cdef inline void place(self, uint64_t entry) noexcept:
        """Put an entry in the first free slot from its home (the table has room)."""
        cdef uint64_t mask = (<uint64_t>1 << self.bits) - 1
        cdef uint64_t at = (entry >> 32) >> (32 - self.bits)
        while self.table[at] != 0:
            at = (at + 1) & mask
        self.table[at] = entry

    cdef int reserve_keys(self, Py_ssize_t extra) except -1:
        """Room in the table for ``extra`` more keys at a load of at most 3/4."""
        cdef Py_ssize_t needed = self.count + extra
        cdef int bits = self.bits if self.bits else MIN_BITS
        while needed * 4 > (<Py_ssize_t>1 << bits) * 3:
            bits += 1
        if bits == self.bits:
            return 0
        if bits > 32:
            raise MemoryError("block table full")
        cdef uint64_t* old = self.table
        cdef Py_ssize_t old_size = (<Py_ssize_t>1 << self.bits) if self.bits else 0, index
        cdef uint64_t* grown = <uint64_t*>malloc((<size_t>1 << bits) * 8)
        if grown == NULL:
            raise MemoryError()
        memset(grown, 0, (<size_t>1 << bits) * 8)
        self.table, self.bits = grown, bits
        for index in range(old_size):
            if old[index] != 0:
                self.place(old[index])
        free(old)
        return 0

    cdef void unlink(self, Py_ssize_t slot) noexcept:
        """Delete the entry at ``slot`` by shifting back the entries probing past it (no tombstones)."""
        cdef uint64_t mask = (<uint64_t>1 << self.bits) - 1
        cdef uint64_t hole = <uint64_t>slot, at = <uint64_t>slot, home, entry
        while True:
            at = (at + 1) & mask
            entry = self.table[at]
            if entry == 0:
                break
            home = (entry >> 32) >> (32 - self.bits)
            # The entry may fill the hole unless its home lies cyclically in (hole, at].
            if (at > hole and (home <= hole or home > at)) or (at < hole and home <= hole and home > at):
                self.table[hole] = entry
                hole = at
        self.table[hole] = 0
        self.count -= 1

    # --- the columns ------------------------------------------------------------------------------------

    cdef int reserve_rows(self, Py_ssize_t extra) except -1:
        cdef Py_ssize_t needed = self.rows + extra
        if needed <= self.row_capacity:
            return 0
        if needed > MAX_ROWS:
            raise MemoryError("block table full")
        cdef Py_ssize_t capacity = needed + (needed >> 3) + 16
        self.set_row_capacity(capacity)
        return 0

    cdef int set_row_capacity(self, Py_ssize_t capacity) except -1:
        cdef void* hashes = realloc(self.hash_col, capacity * 8)
        if hashes == NULL:
            raise MemoryError()
        self.hash_col = <uint64_t*>hashes
        cdef void* parents = realloc(self.parent_col, capacity * 8)
        if parents == NULL:
            raise MemoryError()
        self.parent_col = <uint64_t*>parents
        cdef void* tokens = realloc(self.token_col, capacity * 8)
        if tokens == NULL:
            raise MemoryError()
        self.token_col = <uint64_t*>tokens
        cdef void* flags = realloc(self.flag_col, capacity)
        if flags == NULL:
            raise MemoryError()
        self.flag_col = <uint8_t*>flags
        self.row_capacity = capacity
        return 0

    # --- store and remove (C level: the compiled apply_run calls these) ---------------------------------

    cdef int store_c(
        self, bint has_parent, uint64_t parent, const uint64_t* block_hashes, const uint64_t* tokens_hashes,
        Py_ssize_t count, object infos,
    ) except -1:
        """BlockStore.store over converted values (``infos``: None or a tuple of ``count`` items)."""
        cdef Py_ssize_t index, row
        cdef uint64_t key
        cdef object info
        cdef dict mm = self.mm
        if self.compact_read >= 0:
            self.compact_step()
        # Room first: nothing below can fail half-way.
        self.reserve_rows(count)
        self.reserve_keys(count)
        self.version += 1
        for index in range(count):
            key = block_hashes[index]
            row = self.find(key)
            if row < 0:
                row = self.rows
                self.rows += 1
                self.hash_col[row] = key
                self.place((mix(key) & 0xFFFFFFFF00000000ULL) | <uint64_t>(row + 1))
                self.count += 1
            if has_parent:
                self.parent_col[row] = parent
                self.flag_col[row] = FLAG_PARENT
            else:
                self.parent_col[row] = 0
                self.flag_col[row] = FLAG_ROOT
            self.token_col[row] = tokens_hashes[index]
            if infos is None:
                if mm:
                    mm.pop(row, None)
            else:
                info = <object>PyTuple_GET_ITEM(infos, index)
                if info is None:
                    if mm:
                        mm.pop(row, None)
                else:
                    mm[row] = info
            has_parent = True
            parent = key
        return 0

    cdef int remove_c(self, const uint64_t* block_hashes, Py_ssize_t count) except -1:
        """BlockStore.remove over converted values."""
        cdef Py_ssize_t index, slot, row
        cdef dict mm = self.mm
        self.version += 1
        for index in range(count):
            slot = self.find_slot(block_hashes[index])
            if slot < 0:
                continue
            row = <Py_ssize_t>((self.table[slot] & 0xFFFFFFFFULL) - 1)
            self.unlink(slot)
            # Zeroed so a dump never carries a removed block's data and the order check never follows a
            # stale parent.
            self.hash_col[row] = self.parent_col[row] = self.token_col[row] = 0
            self.flag_col[row] = FLAG_DEAD
            self.dead += 1
            if mm:
                mm.pop(row, None)
        if self.count == 0:
            # Drop the columns outright rather than keep dead rows for an empty store.
            self.release()
            self.mm = {}
            self.compact_read = self.compact_write = -1
        elif self.compact_read >= 0:
            self.compact_step()
        elif self.dead > self.min_free and self.dead > self.count:
            self.compact_read = self.compact_write = (
                <const uint8_t*>memchr(self.flag_col, FLAG_DEAD, self.rows) - self.flag_col
            )
            self.compact_step()
        return 0

    cdef int compact_step(self) except -1:
        """BlockStore._compact_step: move up to ``step_rows`` live rows down over dead ones, in order; drop
        the dead tail once the scan is done."""
        cdef Py_ssize_t read = self.compact_read, write = self.compact_write
        cdef Py_ssize_t budget = self.step_rows, start, end, limit, count, row, vacated
        cdef dict mm = self.mm
        cdef object info
        while budget > 0:
            start = read
            while start < self.rows and self.flag_col[start] == FLAG_DEAD:
                start += 1
            if start >= self.rows:
                # Every row from ``write`` on is dead: drop them.
                self.dead -= self.rows - write
                self.rows = write
                self.compact_read = self.compact_write = -1
                if self.row_capacity > 64 and self.rows < self.row_capacity // 2:
                    self.set_row_capacity(self.rows + (self.rows >> 3) + 16)
                return 0
            end = start
            limit = start + budget
            if limit > self.rows:
                limit = self.rows
            while end < limit and self.flag_col[end] != FLAG_DEAD:
                end += 1
            count = end - start
            if start != write:
                # The table slots first, while every moving hash is still where the table says.
                for row in range(count):
                    self.moved[row] = self.find_slot(self.hash_col[start + row])
                for row in range(count):
                    self.table[self.moved[row]] = (
                        (self.table[self.moved[row]] & 0xFFFFFFFF00000000ULL) | <uint64_t>(write + row + 1)
                    )
                memmove(self.hash_col + write, self.hash_col + start, count * 8)
                memmove(self.parent_col + write, self.parent_col + start, count * 8)
                memmove(self.token_col + write, self.token_col + start, count * 8)
                memmove(self.flag_col + write, self.flag_col + start, count)
                if mm:
                    for row in range(start, end):
                        info = mm.pop(row, None)
                        if info is not None:
                            mm[row - start + write] = info
                vacated = write + count if write + count > start else start
                if vacated < end:
                    memset(self.hash_col + vacated, 0, (end - vacated) * 8)
                    memset(self.parent_col + vacated, 0, (end - vacated) * 8)
                    memset(self.token_col + vacated, 0, (end - vacated) * 8)
                    memset(self.flag_col + vacated, FLAG_DEAD, end - vacated)
            write += count
            read = end
            budget -= count
        self.compact_read, self.compact_write = read, write
        return 0

    # --- the Python interface (kvagent/index/store.py's BlockStore) ----------------------------------------

    def __len__(self):
        return self.count

    def __bool__(self):
        return self.count > 0

    def __contains__(self, block_hash):
        cdef uint64_t key
        return key_of(block_hash, &key) and self.find(key) >= 0

    def row_of(self, block_hash):
        """The row of ``block_hash``, or -1 when it is not resident."""
        cdef uint64_t key
        if not key_of(block_hash, &key):
            return -1
        return self.find(key)

    def store(self, parent_hash, block_hashes, tokens_hashes, mm_extra_infos):
        """Add (or overwrite) a chain: block i's parent is block i-1, block 0's is ``parent_hash``.

        Every value is converted before anything changes: a bad one raises and leaves the store as it was
        (the index validates first, so that does not happen there).
        """
        cdef tuple hash_tuple = tuple(block_hashes), token_tuple = tuple(tokens_hashes)
        cdef tuple infos = None if mm_extra_infos is None else tuple(mm_extra_infos)
        cdef Py_ssize_t count = PyTuple_GET_SIZE(hash_tuple)
        cdef uint64_t parent = 0
        if PyTuple_GET_SIZE(token_tuple) != count:
            raise ValueError("tokens hashes and block hashes differ in length")
        if infos is not None and PyTuple_GET_SIZE(infos) != count:
            raise ValueError("mm_extra_infos and block hashes differ in length")
        # Buffers of this call's own: converting may run Python code (int subclasses), and another thread
        # with another store must not share them.
        cdef Scratch hash_scratch = Scratch(), token_scratch = Scratch()
        cdef uint64_t* hashes = hash_scratch.reserve(count)
        cdef uint64_t* tokens = token_scratch.reserve(count)
        loose_u64s(hash_tuple, hashes)
        loose_u64s(token_tuple, tokens)
        if parent_hash is not None:
            loose_u64s((parent_hash,), &parent)
        self.store_c(parent_hash is not None, parent, hashes, tokens, count, infos)

    def remove(self, block_hashes):
        """Delete the given hashes; unknown hashes (and values no block hash equals) are ignored."""
        cdef tuple values = tuple(block_hashes)
        cdef Py_ssize_t index, kept = 0, count = PyTuple_GET_SIZE(values)
        cdef Scratch scratch = Scratch()
        cdef uint64_t* keys = scratch.reserve(count)
        for index in range(count):
            if key_of(<object>PyTuple_GET_ITEM(values, index), keys + kept):
                kept += 1
        self.remove_c(keys, kept)

    def hashes(self):
        """The resident hashes in row order (a generator; the store must not change while it runs)."""
        cdef Py_ssize_t row = 0, version = self.version
        while row < self.rows:
            if self.version != version:
                raise RuntimeError("BlockTable changed during iteration")
            if self.flag_col[row] != FLAG_DEAD:
                yield self.hash_col[row]
            row += 1
        if self.version != version:
            raise RuntimeError("BlockTable changed during iteration")

    def get(self, block_hash):
        """(parent hash, tokens hash, mm info) of a resident block, or None."""
        cdef uint64_t key
        if not key_of(block_hash, &key):
            return None
        cdef Py_ssize_t row = self.find(key)
        if row < 0:
            return None
        parent = self.parent_col[row] if self.flag_col[row] == FLAG_PARENT else None
        return parent, self.token_col[row], self.mm.get(row)

    def rows_parent_first(self):
        """True when every resident parent sits in an earlier row than its children."""
        cdef Py_ssize_t row, parent_row
        cdef uint64_t parent
        for row in range(self.rows):
            if self.flag_col[row] != FLAG_PARENT:
                continue
            parent = self.parent_col[row]
            if row > 0 and self.flag_col[row - 1] != FLAG_DEAD and self.hash_col[row - 1] == parent:
                continue  # the chain stored in one go: the parent is the previous row
            parent_row = self.find(parent)
            if parent_row >= row:
                return False
        return True

    def column_copies(self):
        """(hashes, parents, tokens, flags, mm, live): copies of the columns in row order."""
        return (
            self.copy_u64(self.hash_col, self.rows),
            self.copy_u64(self.parent_col, self.rows),
            self.copy_u64(self.token_col, self.rows),
            PyBytes_FromStringAndSize(<char*>self.flag_col, self.rows),
            dict(self.mm),
            self.count,
        )

    cdef object copy_u64(self, const uint64_t* column, Py_ssize_t rows):
        if rows == 0:
            return _ARRAY("Q")
        return _ARRAY("Q", PyBytes_FromStringAndSize(<const char*>column, rows * 8))

    def replay_rows(self):
        """BlockStore.replay_order's order as rows: a resident parent before its children (array of u64)."""
        cdef Py_ssize_t rows = self.rows, row, slot, parent_slot, length = 0, chain_length, index
        cdef bytes state_bytes = PyBytes_FromStringAndSize(NULL, rows)
        cdef uint8_t* state = <uint8_t*>PyBytes_AS_STRING(state_bytes)
        memset(state, 0, rows)
        order = _ARRAY("Q", bytes(8 * self.count))
        cdef uint64_t[:] out = order
        chain = _ARRAY("Q")
        for row in range(rows):
            if self.flag_col[row] == FLAG_DEAD or state[row]:
                continue
            if self.flag_col[row] == FLAG_PARENT:
                parent_slot = self.find(self.parent_col[row])
                if parent_slot >= 0 and not state[parent_slot]:
                    # Pull the unemitted ancestors out first; a parent cycle is cut where it closes.
                    del chain[:]
                    chain.append(row)
                    state[row] = 2
                    slot = row
                    while self.flag_col[slot] == FLAG_PARENT:
                        parent_slot = self.find(self.parent_col[slot])
                        if parent_slot < 0 or state[parent_slot]:
                            break
                        chain.append(parent_slot)
                        state[parent_slot] = 2
                        slot = parent_slot
                    chain_length = len(chain)
                    for index in range(chain_length - 1, -1, -1):
                        slot = chain[index]
                        state[slot] = 1
                        out[length] = slot
                        length += 1
                    continue
            state[row] = 1
            out[length] = row
            length += 1
        return order

    def replay_column_copies(self):
        """(hashes, parents, tokens, flags, mm, live) in :meth:`replay_rows` order (BlockStore.replay_columns)."""
        order = self.replay_rows()
        cdef const uint64_t[:] rows = order
        cdef Py_ssize_t count = rows.shape[0], index, row
        hashes = _ARRAY("Q", bytes(8 * count))
        parents = _ARRAY("Q", bytes(8 * count))
        tokens = _ARRAY("Q", bytes(8 * count))
        cdef bytes flags = PyBytes_FromStringAndSize(NULL, count)
        cdef uint64_t[:] out_hashes = hashes
        cdef uint64_t[:] out_parents = parents
        cdef uint64_t[:] out_tokens = tokens
        cdef uint8_t* out_flags = <uint8_t*>PyBytes_AS_STRING(flags)
        cdef dict mm = {}, own = self.mm
        for index in range(count):
            row = rows[index]
            out_hashes[index] = self.hash_col[row]
            out_parents[index] = self.parent_col[row]
            out_tokens[index] = self.token_col[row]
            out_flags[index] = self.flag_col[row]
            if own:
                info = own.get(row)
                if info is not None:
                    mm[index] = info
        return hashes, parents, tokens, flags, mm, count

    def row_entry(self, Py_ssize_t row):
        """(hash, parent or None, tokens hash, mm info) of a live row (replay_order's items)."""
        if not 0 <= row < self.rows or self.flag_col[row] == FLAG_DEAD:
            raise IndexError(row)
        parent = self.parent_col[row] if self.flag_col[row] == FLAG_PARENT else None
        return self.hash_col[row], parent, self.token_col[row], self.mm.get(row) if self.mm else None

    def table_statistics(self):
        """Sizes for tests and diagnostics."""
        return {
            "rows": self.rows,
            "dead": self.dead,
            "compacting": self.compact_read >= 0,
            "table_slots": (1 << self.bits) if self.bits else 0,
            "row_capacity": self.row_capacity,
            "bytes": ((1 << self.bits) if self.bits else 0) * 8 + self.row_capacity * 25,
        }


# --- RecoveryIndex.apply_run (kvagent/index/recovery_index.py) ------------------------------------------------

cdef object _RouterEvent = None
cdef object _Stored = None
cdef object _Removed = None
cdef object _WORKER = None
cdef object _warning = None
cdef object _RingSegment = None
cdef object _segment_append = None
cdef object _apply_errors = None
cdef object _python_segment_append = None


def configure(router_event, stored, removed, worker, warning, ring_segment, segment_append, apply_errors):
    """The model's classes and the index's collaborators (kvagent/index/recovery_index.py calls this).

    ``segment_append`` is how EventRing appends to a segment: ``RingSegment.append`` (the pure-Python ring,
    which this loop then calls) or the compiled one, whose columns this loop writes itself.
    """
    global _RouterEvent, _Stored, _Removed, _WORKER, _warning, _RingSegment, _segment_append, _apply_errors
    global _python_segment_append
    _RouterEvent, _Stored, _Removed, _WORKER = router_event, stored, removed, worker
    _warning, _RingSegment, _segment_append, _apply_errors = warning, ring_segment, segment_append, apply_errors
    _python_segment_append = ring_segment.append


cdef inline int push_u64(array.array column, uint64_t value) except -1:
    cdef Py_ssize_t size = Py_SIZE(column)
    resize_smart(column, size + 1)
    column.data.as_ulonglongs[size] = value
    return 0


cdef inline int push_u64s(array.array column, tuple values) except -1:
    cdef Py_ssize_t size = Py_SIZE(column), count = PyTuple_GET_SIZE(values), index
    resize_smart(column, size + count)
    for index in range(count):
        column.data.as_ulonglongs[size + index] = PyLong_AsUnsignedLongLong(<object>PyTuple_GET_ITEM(values, index))
    return 0


cdef class _Tail:
    """The columns of the ring's newest segment, fetched once per segment, and its last route's code."""
    cdef object segment
    cdef array.array ids, routes, parents, offsets, hashes, tokens
    cdef bytearray kinds
    cdef dict extras, codes
    cdef object worker_id, tier, domain, dp_rank, source, session
    cdef Py_ssize_t code

    def __cinit__(self, segment):
        self.segment = segment
        self.ids, self.routes, self.parents = segment.ids, segment.routes, segment.parents
        self.offsets, self.hashes, self.tokens = segment.offsets, segment.hashes, segment.tokens
        self.kinds, self.extras, self.codes = segment.kinds, segment.extras, segment.route_codes
        self.code = -1

    cdef int append(self, object event) except -1:
        """RingSegment.append / _columns.ring_append (the same columns), with the route's code reused while
        the event's route fields are the very objects of the previous event's."""
        cdef object worker_id = event.worker_id, tier = event.storage_tier, domain = event.residency_domain
        cdef object dp_rank = event.dp_rank, source = event.state_source, session = event.session_id
        cdef object code
        if not (
            self.code >= 0
            and worker_id is self.worker_id
            and tier is self.tier
            and domain is self.domain
            and dp_rank is self.dp_rank
            and source is self.source
            and session is self.session
        ):
            key = (worker_id, tier, domain, dp_rank, id(source), session)
            code = self.codes.get(key)
            if code is None:
                code = self.segment.add_route(event, key)
            self.code = code
            self.worker_id, self.tier, self.domain, self.dp_rank = worker_id, tier, domain, dp_rank
            self.source, self.session = source, session
        cdef object data = event.data
        cdef object cls = type(data)
        cdef Py_ssize_t position = Py_SIZE(self.ids), size, count
        cdef tuple block_hashes
        cdef object parent
        if cls is _Stored:
            parent = data.parent_hash
            if parent is None:
                self.kinds.append(0)
                push_u64(self.parents, 0)
            else:
                self.kinds.append(1)
                push_u64(self.parents, PyLong_AsUnsignedLongLong(parent))
            push_u64s(self.hashes, data.block_hashes)
            push_u64s(self.tokens, data.tokens_hashes)
            if data.mm_extra_infos is not None or data.start_position is not None:
                self.extras[position] = (data.start_position, data.mm_extra_infos)
        elif cls is _Removed:
            self.kinds.append(2)
            push_u64(self.parents, 0)
            block_hashes = data.block_hashes
            push_u64s(self.hashes, block_hashes)
            count = PyTuple_GET_SIZE(block_hashes)
            size = Py_SIZE(self.tokens)
            resize_smart(self.tokens, size + count)
            memset(self.tokens.data.as_ulonglongs + size, 0, count * 8)
        else:
            self.kinds.append(3)
            push_u64(self.parents, 0)
        push_u64(self.ids, PyLong_AsUnsignedLongLong(event.event_id))
        size = Py_SIZE(self.routes)
        resize_smart(self.routes, size + 1)
        self.routes.data.as_ushorts[size] = <uint16_t>self.code
        size = Py_SIZE(self.offsets)
        resize_smart(self.offsets, size + 1)
        self.offsets.data.as_uints[size] = <uint32_t>Py_SIZE(self.hashes)
        return 0


cdef int ring_extend(object ring, list events) except -1:
    """EventRing.append for each of ``events`` (kvagent/index/ring.py), the ring's state kept in locals and
    the newest segment's columns fetched once (the appends write exactly what RingSegment.append does)."""
    cdef object tail = ring._tail
    cdef Py_ssize_t segment_events = ring._segment_events, capacity = ring.capacity
    cdef Py_ssize_t count = ring._count, head = ring._head, tail_length, index
    cdef list segments = ring._segments, firsts = ring._firsts
    cdef object retired = ring._retired  # EventRing.retain: evicted segments kept for the persistence writer
    cdef object event
    cdef _Tail columns = None
    cdef bint compiled = _segment_append is not _python_segment_append
    tail_length = -1 if tail is None else len(tail.kinds)
    try:
        for index in range(PyList_GET_SIZE(events)):
            event = <object>PyList_GET_ITEM(events, index)
            if tail_length < 0 or tail_length >= segment_events:
                tail = _RingSegment(segment_events)
                segments.append(tail)
                firsts.append(event.event_id)
                tail_length = 0
                columns = None
            if compiled:
                if columns is None:
                    columns = _Tail(tail)
                columns.append(event)
            else:
                _segment_append(tail, event)
            tail_length += 1
            count += 1
            if count > capacity:
                count -= 1
                head += 1
                if head >= len(segments[0].kinds):
                    if retired is not None:
                        retired.append(segments[0])
                    del segments[0]
                    del firsts[0]
                    head = 0
    finally:
        ring._tail, ring._count, ring._head = tail, count, head
    return 0


def apply_run(object index, object events):
    """RecoveryIndex.apply_run(events) in one compiled pass: the failures list, or None when it declines
    (an event or id not of the plain shape, including every case the Python method refuses): then nothing
    changed and the Python method runs."""
    if type(events) is not list and type(events) is not tuple:
        return None
    cdef Py_ssize_t total = len(events), position
    if total == 0:
        return None
    cdef object ring = index._ring
    cdef uint64_t gap_end = 0, newest = 0, expected = 0, event_id = 0
    if not as_u64(index._gap_end, &gap_end):
        return None
    cdef bint ring_filled = bool(ring)
    if ring_filled:
        if not as_u64(ring.newest_id(), &newest):
            return None
    if newest < gap_end:
        newest = gap_end
    cdef dict routes = index._routes
    cdef list keys = []
    cdef object event, data, cls, key = None, worker_id = None, dp_rank = None, tier = None
    # --- the run's checks and store keys (RecoveryIndex._run_keys) ---
    for position in range(total):
        event = events[position]
        if type(event) is not _RouterEvent or event.residency_domain is not _WORKER:
            return None
        cls = type(event.data)
        if cls is not _Stored and cls is not _Removed:
            return None
        if not as_u64(event.event_id, &event_id):
            return None
        if position == 0:
            if (ring_filled or gap_end) and event_id <= newest:
                return None
            expected = event_id
        elif event_id != expected:
            return None
        expected += 1
        if not (
            key is not None
            and event.worker_id is worker_id
            and event.dp_rank is dp_rank
            and event.storage_tier is tier
        ):
            worker_id, dp_rank, tier = event.worker_id, event.dp_rank, event.storage_tier
            try:
                key = routes.get((_WORKER, worker_id, dp_rank, None, tier))
                if key is None:
                    key = index._store_key(event)
            except _apply_errors:
                return None
        keys.append(key)
    # --- apply ---
    cdef dict stores = index._stores
    cdef object new_store = index._new_store
    cdef tuple subscribers = index._subscriber_snapshot
    cdef bint announce = len(subscribers) > 0
    cdef list failures = [], applied = []
    cdef Py_ssize_t applied_count = 0, count
    cdef object store_key = None, store = None, parent, hashes, tokens, infos, data_store
    cdef uint64_t parent_value
    cdef uint64_t* hash_values
    cdef uint64_t* token_values
    # This run's conversion buffers (not shared: the loop runs Python code between converting and storing).
    cdef Scratch hash_scratch = Scratch(), token_scratch = Scratch()
    cdef bint plain, native_stores = isinstance(new_store, type) and issubclass(new_store, BlockTable)
    for position in range(total):
        event = events[position]
        key = keys[position]
        event_id = PyLong_AsUnsignedLongLong(event.event_id)
        if event_id != newest + 1 and (ring_filled or gap_end):
            _warning(newest + 1, event.event_id)
        data = event.data
        try:
            if key is not store_key:
                store_key, store = key, stores.get(key)
            if type(data) is _Stored:
                hashes, tokens, infos, parent = (
                    data.block_hashes, data.tokens_hashes, data.mm_extra_infos, data.parent_hash
                )
                plain = (
                    type(hashes) is tuple
                    and type(tokens) is tuple
                    and PyTuple_GET_SIZE(tokens) == PyTuple_GET_SIZE(hashes)
                    and (infos is None or (type(infos) is tuple and PyTuple_GET_SIZE(infos) == PyTuple_GET_SIZE(hashes)))
                    and (isinstance(store, BlockTable) if store is not None else native_stores)
                )
                if plain:
                    count = PyTuple_GET_SIZE(hashes)
                    hash_values = hash_scratch.reserve(count)
                    token_values = token_scratch.reserve(count)
                    parent_value = 0
                    plain = (
                        tuple_u64s(hashes, hash_values)
                        and tuple_u64s(tokens, token_values)
                        and (parent is None or as_u64(parent, &parent_value))
                    )
                if plain:
                    if store is None:
                        store = stores[key] = new_store()
                    (<BlockTable>store).store_c(
                        parent is not None, parent_value, hash_values, token_values, count, infos
                    )
                else:
                    # Anything else (a bad value, an odd store): the Python method, which raises naming it.
                    store_key = None
                    index._store(key, data)
            else:
                hashes = data.block_hashes
                if store is None:
                    pass  # nothing resident under this key: a remove changes nothing
                elif type(hashes) is tuple and isinstance(store, BlockTable):
                    count = PyTuple_GET_SIZE(hashes)
                    hash_values = hash_scratch.reserve(count)
                    if tuple_u64s(hashes, hash_values):
                        (<BlockTable>store).remove_c(hash_values, count)
                    else:
                        (<BlockTable>store).remove(hashes)
                    if not (<BlockTable>store).count:
                        del stores[key]
                        store_key = None
                else:
                    store_key = None
                    index._remove(key, data)
        except Exception as error:  # as apply() raising: not buffered, not announced
            store_key = None
            failures.append((position, error))
            continue
        newest = event_id
        if announce:
            ring.append(event)
            index._applied += 1
            index._announce(event)
            store_key = None  # a subscriber may have changed the stores
        else:
            applied.append(event)
        ring_filled = True
    if applied:
        ring_extend(ring, applied)
        index._applied += len(applied)
    index._dump_cache = None
    return failures
