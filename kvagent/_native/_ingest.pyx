# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The native ingest core: one pass from a vLLM batch payload to placement events, and the coordinator's
plain-chunk pass (coalesce check, dedup, outbound ids, RouterEvents).

Both passes handle only the plain shapes and *decline* (return None) everything else before changing any
state, so the Python path, which defines the behaviour, takes it:

- :func:`normalize_payload` reads the msgpack bytes itself (no msgpack or msgspec object per field): the
  ``[ts, events, rank]`` envelope with map-form ``BlockStored`` / ``BlockRemoved`` events that
  ``AttachmentNormalizer.normalize`` would take on its inline plain path (framework ownership, device medium,
  local, no LoRA, salt, multimodal extra keys or duplicate hash, whole blocks of the attachment's block
  size, main attention). It packs the tokens, hashes each block with XXH3-64 (seed 1337; the system's
  libxxhash when setup.py found it, else the xxhash package) and builds the ``Stored`` / ``Removed`` / ``PlacementEvent`` values straight from their slots.
  Attention groups the batch teaches are returned as writes for the caller to apply once the batch is
  accepted (its rank checked), so a declined or refused batch changes nothing.
- :func:`stamp_plain_chunk` is ``coordinator/fastpath.py``'s loop: the plain check, coalescing only when an
  adjacent pair may merge (Python's ``coalesce``), the dedup of the common cases at C speed (anything
  else goes through ``DedupFilter.filter`` for that event, in order), outbound ids and RouterEvents.

``kvagent/_native/__init__.py`` decides whether this module is used; ``tests/unit/test_fast_path_batch.py``
and ``tests/unit/test_fastpath.py`` run both paths and pin them to the same results.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_GetItem
from cpython.list cimport PyList_Append, PyList_New
from cpython.long cimport PyLong_FromLongLong, PyLong_FromUnsignedLongLong
from cpython.object cimport PyObject, PyTypeObject
from cpython.set cimport PySet_Add, PySet_Contains, PySet_Discard, PySet_GET_SIZE
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from cpython.unicode cimport PyUnicode_DecodeUTF8
from cpython.ref cimport Py_INCREF
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, qsort
from libc.string cimport memcmp, memcpy

cdef extern from "Python.h":
    void PyObject_GC_UnTrack(void* op)

cdef extern from "_support.h":
    bint KV_SYSTEM_XXH3  # libxxhash's XXH3 compiled in (setup.py found it); else the xxhash package's
    uint64_t XXH3_64bits_withSeed(const void* data, size_t length, uint64_t seed) nogil
    Py_ssize_t kv_member_offset(object descr) except? -2
    object kv_alloc(PyTypeObject* type)
    void kv_set(PyObject* obj, Py_ssize_t offset, object value)
    PyObject* kv_get(PyObject* obj, Py_ssize_t offset)

from xxhash import xxh3_64_intdigest as _package_xxh3  # the per-block hash when built without libxxhash

# Where this build's XXH3 comes from (``kvagent --version`` does not say; docs/performance.md measures both).
XXH3_SOURCE = "libxxhash" if KV_SYSTEM_XXH3 else "xxhash package"

cdef enum:
    BASE_SEED = 1337
cdef uint64_t U32_MAX = 0xFFFFFFFF

# --- value types, built from their slot offsets (configure) ---------------------------------------------

cdef PyTypeObject* _stored_type = NULL
cdef PyTypeObject* _removed_type = NULL
cdef PyTypeObject* _placement_type = NULL
cdef PyTypeObject* _router_type = NULL
cdef object _stored_cls = None
cdef object _removed_cls = None
cdef object _placement_cls = None
cdef object _router_cls = None
cdef Py_ssize_t _stored_off[6]
cdef Py_ssize_t _removed_off[1]
cdef Py_ssize_t _placement_off[5]
cdef Py_ssize_t _router_off[8]
cdef object _device = None
cdef object _worker = None
cdef object _cleared = None
cdef bint _configured = False

_STORED_FIELDS = ("parent_hash", "block_hashes", "tokens_hashes", "mm_extra_infos", "start_position", "token_bytes")
_REMOVED_FIELDS = ("block_hashes",)
_PLACEMENT_FIELDS = ("data", "tier", "domain", "dp_rank", "session_id")
_ROUTER_FIELDS = (
    "worker_id", "storage_tier", "residency_domain", "event_id", "data", "dp_rank", "state_source", "session_id"
)


cdef int _offsets(object cls, tuple names, tuple declared, Py_ssize_t* out) except -1:
    if tuple(declared) != names:
        raise TypeError(f"{cls.__name__} fields are {declared}, the native core builds {names}")
    slots = set(getattr(cls, "__slots__", ()))
    for base in cls.__mro__[1:]:
        slots.update(getattr(base, "__slots__", ()))
    slots.discard("__weakref__")
    if slots != set(names):
        raise TypeError(f"{cls.__name__} has slots {sorted(slots)}, the native core fills {sorted(names)}")
    for i, name in enumerate(names):
        offset = kv_member_offset(cls.__dict__.get(name))
        if offset < 0:
            raise TypeError(f"{cls.__name__}.{name} is not a writable slot")
        out[i] = offset
    return 0


def configure(stored, removed, placement, router, device, worker, cleared, fields):
    """Bind the model's value classes (``fields``: each class's attrs field names, in order), the Device
    tier, the Worker domain and the ``CLEARED`` value."""
    global _stored_cls, _removed_cls, _placement_cls, _router_cls, _device, _worker, _cleared, _configured
    global _stored_type, _removed_type, _placement_type, _router_type
    _offsets(stored, _STORED_FIELDS, fields[0], _stored_off)
    _offsets(removed, _REMOVED_FIELDS, fields[1], _removed_off)
    _offsets(placement, _PLACEMENT_FIELDS, fields[2], _placement_off)
    _offsets(router, _ROUTER_FIELDS, fields[3], _router_off)
    _stored_cls, _removed_cls, _placement_cls, _router_cls = stored, removed, placement, router
    _stored_type = <PyTypeObject*>stored
    _removed_type = <PyTypeObject*>removed
    _placement_type = <PyTypeObject*>placement
    _router_type = <PyTypeObject*>router
    _device, _worker, _cleared = device, worker, cleared
    _configured = True


cdef object new_stored(object parent, object hashes, object tokens_hashes, object token_bytes):
    cdef object made = kv_alloc(_stored_type)
    cdef PyObject* obj = <PyObject*>made
    kv_set(obj, _stored_off[0], parent)
    kv_set(obj, _stored_off[1], hashes)
    kv_set(obj, _stored_off[2], tokens_hashes)
    kv_set(obj, _stored_off[3], None)
    kv_set(obj, _stored_off[4], None)
    kv_set(obj, _stored_off[5], token_bytes)
    _untrack(made)
    return made


cdef object new_removed(object hashes):
    cdef object made = kv_alloc(_removed_type)
    cdef PyObject* obj = <PyObject*>made
    kv_set(obj, _removed_off[0], hashes)
    _untrack(made)
    return made


cdef object new_placement(object data, object tier, object domain, object rank, object session):
    cdef object made = kv_alloc(_placement_type)
    cdef PyObject* obj = <PyObject*>made
    kv_set(obj, _placement_off[0], data)
    kv_set(obj, _placement_off[1], tier)
    kv_set(obj, _placement_off[2], domain)
    kv_set(obj, _placement_off[3], rank)
    kv_set(obj, _placement_off[4], session)
    _untrack(made)
    return made


cdef object new_router(object worker_id, object tier, object domain, object event_id, object data,
                       object rank, object owner, object session):
    cdef object made = kv_alloc(_router_type)
    cdef PyObject* obj = <PyObject*>made
    kv_set(obj, _router_off[0], worker_id)
    kv_set(obj, _router_off[1], tier)
    kv_set(obj, _router_off[2], domain)
    kv_set(obj, _router_off[3], event_id)
    kv_set(obj, _router_off[4], data)
    kv_set(obj, _router_off[5], rank)
    kv_set(obj, _router_off[6], owner)
    kv_set(obj, _router_off[7], session)
    _untrack(made)
    return made


cdef inline void _untrack(object value):
    """Leave a value the native pass built out of the cyclic GC's young generation.

    Its fields are ints, tuples of ints, bytes, strings, enum members and other such values: it can never be
    part of a reference cycle, and a burst builds several per event, each otherwise traversed by every
    young collection.
    """
    PyObject_GC_UnTrack(<void*>value)


def build_stored(parent, hashes, tokens_hashes, token_bytes):
    """A Stored built the native way (for the layout self-check of kvagent/_native/__init__.py)."""
    return new_stored(parent, hashes, tokens_hashes, token_bytes)


def build_router(worker_id, tier, domain, event_id, data, rank, owner, session):
    """A RouterEvent built the native way (for the layout self-check)."""
    return new_router(worker_id, tier, domain, event_id, data, rank, owner, session)


# --- msgpack, read in place ---------------------------------------------------------------------------

cdef struct Reader:
    const uint8_t* p
    const uint8_t* end

# Every reader returns 0 on success and -1 to decline (anything unexpected: the Python decoders decide).

cdef inline uint32_t _be16(const uint8_t* p) noexcept nogil:
    return (<uint32_t>p[0] << 8) | p[1]


cdef inline uint32_t _be32(const uint8_t* p) noexcept nogil:
    return (<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | p[3]


cdef inline uint64_t _be64(const uint8_t* p) noexcept nogil:
    return (<uint64_t>_be32(p) << 32) | _be32(p + 4)


cdef inline int _container(Reader* r, uint8_t fix_base, uint8_t tag16, Py_ssize_t* n) noexcept nogil:
    if r.p >= r.end:
        return -1
    cdef uint8_t b = r.p[0]
    if fix_base <= b <= fix_base + 15:
        n[0] = b & 0x0F
        r.p += 1
        return 0
    if b == tag16:
        if r.end - r.p < 3:
            return -1
        n[0] = _be16(r.p + 1)
        r.p += 3
        return 0
    if b == tag16 + 1:
        if r.end - r.p < 5:
            return -1
        n[0] = _be32(r.p + 1)
        r.p += 5
        return 0
    return -1


cdef inline int read_array(Reader* r, Py_ssize_t* n) noexcept nogil:
    return _container(r, 0x90, 0xDC, n)


cdef inline int read_map(Reader* r, Py_ssize_t* n) noexcept nogil:
    return _container(r, 0x80, 0xDE, n)


cdef inline bint read_nil(Reader* r) noexcept nogil:
    """Consume a nil if one is next."""
    if r.p < r.end and r.p[0] == 0xC0:
        r.p += 1
        return True
    return False


cdef inline int read_int(Reader* r, uint64_t* value, bint* negative) noexcept nogil:
    """An integer of any msgpack width: its two's complement bits, and whether it is negative."""
    if r.p >= r.end:
        return -1
    cdef uint8_t b = r.p[0]
    cdef Py_ssize_t left = r.end - r.p
    cdef int64_t s
    negative[0] = False
    if b <= 0x7F:
        value[0] = b
        r.p += 1
        return 0
    if b >= 0xE0:
        value[0] = <uint64_t><int64_t>(<signed char>b)
        negative[0] = True
        r.p += 1
        return 0
    if b == 0xCC and left >= 2:
        value[0] = r.p[1]
        r.p += 2
        return 0
    if b == 0xCD and left >= 3:
        value[0] = _be16(r.p + 1)
        r.p += 3
        return 0
    if b == 0xCE and left >= 5:
        value[0] = _be32(r.p + 1)
        r.p += 5
        return 0
    if b == 0xCF and left >= 9:
        value[0] = _be64(r.p + 1)
        r.p += 9
        return 0
    if b == 0xD0 and left >= 2:
        s = <signed char>r.p[1]
        r.p += 2
    elif b == 0xD1 and left >= 3:
        s = <short>_be16(r.p + 1)
        r.p += 3
    elif b == 0xD2 and left >= 5:
        s = <int>_be32(r.p + 1)
        r.p += 5
    elif b == 0xD3 and left >= 9:
        s = <int64_t>_be64(r.p + 1)
        r.p += 9
    else:
        return -1
    value[0] = <uint64_t>s
    negative[0] = s < 0
    return 0


cdef inline int read_uint(Reader* r, uint64_t* value) noexcept nogil:
    """A non-negative integer (a u64 hash, a u32 token): a negative one declines."""
    cdef bint negative
    if read_int(r, value, &negative) < 0 or negative:
        return -1
    return 0


cdef inline int read_str(Reader* r, const char** text, Py_ssize_t* n) noexcept nogil:
    if r.p >= r.end:
        return -1
    cdef uint8_t b = r.p[0]
    cdef Py_ssize_t length, head
    if 0xA0 <= b <= 0xBF:
        length, head = b & 0x1F, 1
    elif b == 0xD9 and r.end - r.p >= 2:
        length, head = r.p[1], 2
    elif b == 0xDA and r.end - r.p >= 3:
        length, head = _be16(r.p + 1), 3
    elif b == 0xDB and r.end - r.p >= 5:
        length, head = _be32(r.p + 1), 5
    else:
        return -1
    if r.end - r.p - head < length:
        return -1
    text[0] = <const char*>(r.p + head)
    n[0] = length
    r.p += head + length
    return 0


cdef inline bint _is(const char* text, Py_ssize_t n, const char* literal, Py_ssize_t literal_n) noexcept nogil:
    return n == literal_n and memcmp(text, literal, n) == 0


# --- one event ------------------------------------------------------------------------------------------

# Field bits of an event map.
cdef enum:
    F_TYPE = 1 << 0
    F_HASHES = 1 << 1
    F_PARENT = 1 << 2
    F_TOKENS = 1 << 3
    F_BLOCK_SIZE = 1 << 4
    F_LORA_ID = 1 << 5
    F_MEDIUM = 1 << 6
    F_LORA_NAME = 1 << 7
    F_EXTRA_KEYS = 1 << 8
    F_GROUP = 1 << 9
    F_KIND = 1 << 10
    F_WINDOW = 1 << 11
    F_LOCALITY = 1 << 12
    F_OWNERSHIP = 1 << 13
    F_SESSION = 1 << 14
    F_SALT = 1 << 15

cdef enum:
    STORED_REQUIRED = F_TYPE | F_HASHES | F_PARENT | F_TOKENS | F_BLOCK_SIZE
    REMOVED_ALLOWED = F_TYPE | F_HASHES | F_MEDIUM | F_GROUP | F_KIND | F_WINDOW | F_LOCALITY | F_OWNERSHIP
    CLEARED_ALLOWED = F_TYPE | F_MEDIUM | F_LOCALITY | F_OWNERSHIP
    TAG_STORED = 1
    TAG_REMOVED = 2
    TAG_CLEARED = 3

# kv_cache_spec_kind: absent or empty, a main attention kind (anything else declines: it may be filtered).
cdef enum:
    KIND_NONE = 0
    KIND_FULL = 1
    KIND_MLA = 2
    KIND_SINK = 3

cdef tuple _KINDS = (None, "full_attention", "mla_attention", "sink_full_attention")
cdef frozenset _MAIN_KINDS = frozenset(_KINDS[1:])


cdef struct Event:
    int tag
    uint32_t seen
    const uint8_t* hashes_at
    Py_ssize_t hash_count
    bint has_parent
    uint64_t parent
    const uint8_t* tokens_at
    Py_ssize_t token_count
    bint block_size_ok  # an integer equal to the attachment's block size
    int kind
    bint has_group
    int64_t group
    bint has_window
    int64_t window
    const char* session
    Py_ssize_t session_n
    bint has_session
    bint has_medium


cdef int read_hashes(Reader* r, Event* e) noexcept nogil:
    cdef Py_ssize_t n, i
    cdef uint64_t value
    if read_array(r, &n) < 0:
        return -1
    e.hashes_at = r.p
    e.hash_count = n
    for i in range(n):
        if read_uint(r, &value) < 0:
            return -1
    return 0


cdef int read_tokens(Reader* r, Event* e) noexcept nogil:
    cdef Py_ssize_t n, i
    cdef uint64_t value
    if read_array(r, &n) < 0:
        return -1
    e.tokens_at = r.p
    e.token_count = n
    for i in range(n):
        if read_uint(r, &value) < 0 or value > U32_MAX:
            return -1
    return 0


cdef int read_optional_int(Reader* r, bint* present, int64_t* out) noexcept nogil:
    cdef uint64_t value
    cdef bint negative
    if read_nil(r):
        present[0] = False
        return 0
    if read_int(r, &value, &negative) < 0:
        return -1
    if not negative and value > <uint64_t>0x7FFFFFFFFFFFFFFF:
        return -1  # a huge group or window: rare enough to leave to Python
    present[0] = True
    out[0] = <int64_t>value
    return 0


cdef int read_event(Reader* r, Event* e, int64_t block_size) noexcept nogil:
    """One map-form event into ``e``, or -1 when it is not a plain store or remove."""
    cdef Py_ssize_t fields, i, n
    cdef const char* key
    cdef const char* text
    cdef Py_ssize_t key_n
    cdef uint32_t bit
    cdef uint64_t value
    cdef bint negative, present
    cdef int64_t ignored
    e.seen = 0
    e.tag = 0
    e.has_parent = False
    e.block_size_ok = False
    e.kind = KIND_NONE
    e.has_group = False
    e.has_window = False
    e.has_session = False
    e.has_medium = False
    if read_map(r, &fields) < 0:
        return -1  # the positional form, or not an event at all
    for i in range(fields):
        if read_str(r, &key, &key_n) < 0:
            return -1
        if _is(key, key_n, "type", 4):
            bit = F_TYPE
            if read_str(r, &text, &n) < 0:
                return -1
            if _is(text, n, "BlockStored", 11):
                e.tag = TAG_STORED
            elif _is(text, n, "BlockRemoved", 12):
                e.tag = TAG_REMOVED
            elif _is(text, n, "AllBlocksCleared", 16):
                e.tag = TAG_CLEARED
            else:
                return -1
        elif _is(key, key_n, "block_hashes", 12):
            bit = F_HASHES
            if read_hashes(r, e) < 0:
                return -1
        elif _is(key, key_n, "parent_block_hash", 17):
            bit = F_PARENT
            if not read_nil(r):
                if read_uint(r, &e.parent) < 0:
                    return -1
                e.has_parent = True
        elif _is(key, key_n, "token_ids", 9):
            bit = F_TOKENS
            if read_tokens(r, e) < 0:
                return -1
        elif _is(key, key_n, "block_size", 10):
            bit = F_BLOCK_SIZE
            if read_int(r, &value, &negative) < 0:
                return -1
            e.block_size_ok = not negative and value == <uint64_t>block_size
        elif _is(key, key_n, "lora_id", 7):
            bit = F_LORA_ID
            if read_optional_int(r, &present, &ignored) < 0:
                return -1
        elif _is(key, key_n, "medium", 6):
            bit = F_MEDIUM
            if not read_nil(r):
                if read_str(r, &text, &n) < 0:
                    return -1
                if n != 0:
                    e.has_medium = True  # a scoped clear is filtered: only stores and removes take one
                    if not (_is(text, n, "GPU", 3) or _is(text, n, "DEVICE", 6)):
                        return -1
        elif _is(key, key_n, "lora_name", 9):
            bit = F_LORA_NAME
            if not read_nil(r):
                if read_str(r, &text, &n) < 0 or n != 0:
                    return -1
        elif _is(key, key_n, "extra_keys", 10):
            bit = F_EXTRA_KEYS
            if not read_nil(r):
                if read_array(r, &n) < 0:
                    return -1
                for _ in range(n):
                    if not read_nil(r):
                        return -1  # multimodal hashes, a salt, a LoRA name: the general path
        elif _is(key, key_n, "group_idx", 9):
            bit = F_GROUP
            if read_optional_int(r, &e.has_group, &e.group) < 0:
                return -1
        elif _is(key, key_n, "kv_cache_spec_kind", 18):
            bit = F_KIND
            if not read_nil(r):
                if read_str(r, &text, &n) < 0:
                    return -1
                if n == 0:
                    e.kind = KIND_NONE
                elif _is(text, n, "full_attention", 14):
                    e.kind = KIND_FULL
                elif _is(text, n, "mla_attention", 13):
                    e.kind = KIND_MLA
                elif _is(text, n, "sink_full_attention", 19):
                    e.kind = KIND_SINK
                else:
                    return -1
        elif _is(key, key_n, "kv_cache_spec_sliding_window", 28):
            bit = F_WINDOW
            if read_optional_int(r, &e.has_window, &e.window) < 0:
                return -1
        elif _is(key, key_n, "locality", 8):
            bit = F_LOCALITY
            if not read_nil(r):
                if read_str(r, &text, &n) < 0 or not _is(text, n, "LOCAL", 5):
                    return -1
        elif _is(key, key_n, "ownership", 9):
            bit = F_OWNERSHIP
            if not read_nil(r):
                return -1  # KVCR, or an unknown ownership: the general path
        elif _is(key, key_n, "session_id", 10):
            bit = F_SESSION
            if not read_nil(r):
                if read_str(r, &e.session, &e.session_n) < 0:
                    return -1
                e.has_session = True
        elif _is(key, key_n, "cache_salt", 10):
            bit = F_SALT
            if not read_nil(r):
                if read_str(r, &text, &n) < 0 or n != 0:
                    return -1
        else:
            return -1  # a key the decoders may treat differently
        if e.seen & bit:
            return -1  # a repeated key
        e.seen |= bit
    if e.tag == TAG_STORED:
        if (e.seen & STORED_REQUIRED) != STORED_REQUIRED or not e.block_size_ok or e.hash_count == 0:
            return -1
        if e.token_count < e.hash_count * block_size:
            return -1
    elif e.tag == TAG_REMOVED:
        if not (e.seen & F_HASHES) or (e.seen & ~REMOVED_ALLOWED):
            return -1
    elif e.tag == TAG_CLEARED:
        if (e.seen & ~CLEARED_ALLOWED) or e.has_medium:
            return -1
    else:
        return -1
    return 0


cdef inline uint64_t _hash_at(const uint8_t** p) noexcept nogil:
    cdef Reader r
    cdef uint64_t value = 0
    r.p = p[0]
    r.end = p[0] + 9
    read_uint(&r, &value)  # validated by read_hashes
    p[0] = r.p
    return value


cdef int _compare_u64(const void* a, const void* b) noexcept nogil:
    cdef uint64_t x = (<const uint64_t*>a)[0], y = (<const uint64_t*>b)[0]
    return (x > y) - (x < y)


cdef int distinct_and_parent_apart(const uint8_t* at, Py_ssize_t count, bint has_parent, uint64_t parent) noexcept nogil:
    """1 when the chain's hashes are distinct and its parent is not one of them, 0 when not, -1 when out of
    memory (the caller declines)."""
    cdef uint64_t small[64]
    cdef uint64_t* values = small
    cdef Py_ssize_t i, j
    cdef int verdict = 1
    if count > 64:
        values = <uint64_t*>malloc(count * sizeof(uint64_t))
        if values == NULL:
            return -1
    for i in range(count):
        values[i] = _hash_at(&at)
        if has_parent and values[i] == parent:
            verdict = 0
    if verdict and count <= 64:
        for i in range(count):
            for j in range(i):
                if values[j] == values[i]:
                    return 0
    elif verdict:
        # A long chain (a long prompt's prefill): sorted, a repeat sits next to its twin.
        qsort(values, count, sizeof(uint64_t), _compare_u64)
        for i in range(1, count):
            if values[i] == values[i - 1]:
                verdict = 0
                break
    if values != small:
        free(values)
    return verdict


cdef tuple hashes_tuple(const uint8_t* at, Py_ssize_t count):
    cdef tuple out = PyTuple_New(count)
    cdef Py_ssize_t i
    cdef object value
    for i in range(count):
        value = PyLong_FromUnsignedLongLong(_hash_at(&at))
        Py_INCREF(value)
        PyTuple_SET_ITEM(out, i, value)
    _untrack(out)  # ints only
    return out


cdef object group_learned(dict groups, list writes, object rank, int64_t group):
    """The (kind, window) learned for ``group`` so far, the batch's own writes first (None: not learned)."""
    cdef Py_ssize_t i
    for i in range(len(writes) - 1, -1, -1):
        key, learned = writes[i]
        if key[1] == group:
            return learned
    return groups.get((rank, group))


def normalize_payload(bytes payload, Py_ssize_t block_size, object rank, dict groups):
    """``(batch rank, placement events, blocks, group writes)`` of a plain batch, or None to decline.

    ``rank`` is the attachment's dp rank (its events carry it); ``groups`` the framework normalizer's learned
    attention groups, read only: the writes (``[((rank, group_idx), (kind, window)), ...]`` in order) are
    for the caller to apply once it accepts the batch.
    """
    if not _configured:
        return None
    cdef Reader r
    r.p = <const uint8_t*>PyBytes_AS_STRING(payload)
    r.end = r.p + PyBytes_GET_SIZE(payload)
    cdef Py_ssize_t envelope, count, i, blocks = 0, k
    cdef Event e
    cdef uint64_t batch_rank = 0
    cdef bint has_rank = False
    cdef const uint8_t* at
    cdef uint64_t token = 0
    cdef Py_ssize_t token_bytes_n, block_bytes = 4 * block_size
    cdef bytes packed
    cdef uint8_t* out
    cdef tuple tokens_hashes
    cdef object parent, session, learned, value
    cdef list writes = []
    cdef list events
    cdef Reader tr
    if block_size <= 0 or block_size > 1 << 20:
        return None
    if read_array(&r, &envelope) < 0 or envelope < 2 or envelope > 3:
        return None
    if r.p >= r.end or (r.p[0] != 0xCB and r.p[0] != 0xCA):
        return None  # ts: a float (an int or a bool is the Python decoders' to judge)
    r.p += 9 if r.p[0] == 0xCB else 5
    if r.p > r.end or read_array(&r, &count) < 0:
        return None
    events = PyList_New(0)
    for i in range(count):
        if read_event(&r, &e, block_size) < 0:
            return None
        if e.tag == TAG_CLEARED:
            # A framework Worker clear (no medium): Python's normalize also forgets the cache namespaces,
            # which the caller checked are none.
            events.append(new_placement(_cleared, _device, _worker, rank, None))
            continue
        if e.has_group or e.kind != KIND_NONE:
            # AttentionRejection: a main kind passes (a store with a group teaches it); without a kind, the
            # group's learned kind decides, and an unlearned group other than 0 is filtered.
            if e.kind != KIND_NONE:
                if e.has_group and e.tag == TAG_STORED:
                    value = (_KINDS[e.kind], PyLong_FromLongLong(e.window) if e.has_window else None)
                    if group_learned(groups, writes, rank, e.group) != value:
                        writes.append(((rank, PyLong_FromLongLong(e.group)), value))
            else:
                learned = group_learned(groups, writes, rank, e.group)
                if learned is None:
                    if e.group != 0:
                        return None
                elif learned[0] not in _MAIN_KINDS:
                    return None
        if e.tag == TAG_REMOVED:
            value = new_removed(hashes_tuple(e.hashes_at, e.hash_count))
            events.append(new_placement(value, _device, _worker, rank, None))
            blocks += e.hash_count
            continue
        if distinct_and_parent_apart(e.hashes_at, e.hash_count, e.has_parent, e.parent) != 1:
            return None
        # Whole blocks only: the tokens of the published blocks, packed u32 little-endian, one XXH3 each.
        token_bytes_n = e.hash_count * block_bytes
        packed = PyBytes_FromStringAndSize(NULL, token_bytes_n)
        out = <uint8_t*>PyBytes_AS_STRING(packed)
        tr.p = e.tokens_at
        tr.end = r.p
        for k in range(e.hash_count * block_size):
            read_uint(&tr, &token)
            out[4 * k] = token & 0xFF
            out[4 * k + 1] = (token >> 8) & 0xFF
            out[4 * k + 2] = (token >> 16) & 0xFF
            out[4 * k + 3] = (token >> 24) & 0xFF
        tokens_hashes = PyTuple_New(e.hash_count)
        for k in range(e.hash_count):
            if KV_SYSTEM_XXH3:
                value = PyLong_FromUnsignedLongLong(XXH3_64bits_withSeed(out + k * block_bytes, block_bytes, BASE_SEED))
            else:
                value = _package_xxh3(PyBytes_FromStringAndSize(<char*>out + k * block_bytes, block_bytes), BASE_SEED)
            Py_INCREF(value)
            PyTuple_SET_ITEM(tokens_hashes, k, value)
        _untrack(tokens_hashes)
        parent = PyLong_FromUnsignedLongLong(e.parent) if e.has_parent else None
        session = None
        if e.has_session:
            try:
                session = PyUnicode_DecodeUTF8(e.session, e.session_n, NULL)
            except UnicodeDecodeError:
                return None
        value = new_stored(parent, hashes_tuple(e.hashes_at, e.hash_count), tokens_hashes, packed)
        events.append(new_placement(value, _device, _worker, rank, session))
        blocks += e.hash_count
    if envelope == 3 and not read_nil(&r):
        if read_uint(&r, &batch_rank) < 0 or batch_rank > U32_MAX:
            return None
        has_rank = True
    if r.p != r.end:
        return None  # trailing bytes: the decoders refuse them
    return (PyLong_FromUnsignedLongLong(batch_rank) if has_rank else None), events, blocks, writes


# --- the coordinator's plain chunk ----------------------------------------------------------------------

cdef inline object _field(object obj, Py_ssize_t offset):
    return <object>kv_get(<PyObject*>obj, offset)


def stamp_plain_chunk(events, object slot_rank, object worker_id, object owner, uint64_t first_id,
                      uint64_t id_limit, object dedup, object coalesce, object ids_taken):
    """``(RouterEvents, removes swallowed)`` of a plain chunk, as ``coordinator/fastpath.py`` stamps them.

    None, before any state changes, when the chunk is not plain (only Worker-domain Stored/Removed of
    ``slot_rank`` are) or could need an id at or past ``id_limit``. ``dedup`` is the coordinator's
    DedupFilter: its common cases run here, on its own sets; any other event goes through its ``filter``.
    ``ids_taken(next_id)`` is told the next free id however the loop ends.
    """
    if not _configured:
        return None
    cdef object event, data, previous_type = None, previous_data = None, cls, merged
    cdef bint may_merge = False
    cdef Py_ssize_t count = len(events)
    for event in events:
        if type(event) is not _placement_cls:
            return None
        data = _field(event, _placement_off[0])
        cls = type(data)
        if (cls is not _stored_cls and cls is not _removed_cls) or _field(event, _placement_off[2]) is not _worker:
            return None
        if _field(event, _placement_off[3]) != slot_rank:
            return None
        if not may_merge and previous_type is cls:
            if cls is _removed_cls:
                may_merge = True
            else:
                hashes = _field(previous_data, _stored_off[1])
                if hashes and _field(data, _stored_off[0]) == hashes[len(hashes) - 1]:
                    may_merge = True
        previous_type, previous_data = cls, data
    merged = coalesce(events) if may_merge else events
    if id_limit < first_id or <uint64_t>len(merged) > id_limit - first_id:
        return None
    cdef dict states = dedup._states
    cdef object key = None, key_rank = None, key_tier = None, state, ones, extra, result, tier, rank
    cdef object filter_event = dedup.filter
    cdef list stamped = PyList_New(0)
    cdef Py_ssize_t swallowed = 0, before, n
    cdef uint64_t event_id = first_id
    cdef PyObject* found
    try:
        for event in merged:
            data = _field(event, _placement_off[0])
            tier = _field(event, _placement_off[1])
            rank = _field(event, _placement_off[3])
            cls = type(data)
            hashes = _field(data, _stored_off[1] if cls is _stored_cls else _removed_off[0])
            n = len(hashes)
            result = event
            if n:
                if key is None or rank is not key_rank or tier is not key_tier:
                    key, key_rank, key_tier = (rank, tier, _worker), rank, tier
                found = PyDict_GetItem(states, key)
                if cls is _stored_cls:
                    if found == NULL:
                        result = filter_event(event)  # a new state
                    else:
                        state = <object>found
                        ones, extra = state.ones, state.extra
                        if extra or any_in(ones, hashes):
                            result = filter_event(event)
                        else:
                            before = PySet_GET_SIZE(ones)
                            for h in hashes:
                                PySet_Add(ones, h)
                            if PySet_GET_SIZE(ones) - before != n:
                                state.recount_repeats(hashes)  # the chain lists a hash twice
                elif found != NULL:
                    state = <object>found
                    ones, extra = state.ones, state.extra
                    if extra:
                        result = filter_event(event)
                    else:
                        for h in hashes:
                            PySet_Discard(ones, h)
                        if PySet_GET_SIZE(ones) == 0:
                            del states[key]
            elif cls is _removed_cls:
                result = None  # nothing to remove: consumes no id
            if result is None:
                swallowed += 1
                continue
            if type(result) is not _placement_cls:
                raise TypeError(f"DedupFilter.filter returned {type(result).__name__}, not a PlacementEvent")
            stamped.append(
                new_router(
                    worker_id,
                    _field(result, _placement_off[1]),
                    _worker,
                    PyLong_FromUnsignedLongLong(event_id),
                    _field(result, _placement_off[0]),
                    _field(result, _placement_off[3]),
                    owner,
                    _field(result, _placement_off[4]),
                )
            )
            event_id += 1
    finally:
        ids_taken(PyLong_FromUnsignedLongLong(event_id))
    return stamped, swallowed


cdef bint any_in(object members, object hashes) except -1:
    for h in hashes:
        if PySet_Contains(members, h):
            return True
    return False


def chunk_blocks(events):
    """The blocks of a chunk's events (``len(data.block_hashes)`` summed), or -1 when one is not a
    PlacementEvent of Stored, Removed or Cleared (the caller counts in Python then)."""
    if not _configured:
        return -1
    cdef Py_ssize_t blocks = 0
    cdef object event, data, cls
    for event in events:
        if type(event) is not _placement_cls:
            return -1
        data = _field(event, _placement_off[0])
        cls = type(data)
        if cls is _stored_cls:
            blocks += len(_field(data, _stored_off[1]))
        elif cls is _removed_cls:
            blocks += len(_field(data, _removed_off[0]))
        elif data is not _cleared:
            return -1
    return blocks


# --- outbound: RouterEvents as msgpack named maps (wire/router_event.py's encode_router_events) -------------

from cpython.unicode cimport PyUnicode_AsUTF8AndSize
from libc.stdlib cimport realloc

cdef struct Buffer:
    char* data
    Py_ssize_t size
    Py_ssize_t capacity


cdef int _reserve(Buffer* b, Py_ssize_t extra) except -1:
    cdef Py_ssize_t wanted = b.size + extra, capacity
    cdef char* grown
    if wanted <= b.capacity:
        return 0
    capacity = max(2 * b.capacity, wanted, 256)
    grown = <char*>realloc(b.data, capacity)
    if grown == NULL:
        raise MemoryError()
    b.data, b.capacity = grown, capacity
    return 0


cdef inline int _byte(Buffer* b, uint8_t value) except -1:
    _reserve(b, 1)
    b.data[b.size] = <char>value
    b.size += 1
    return 0


cdef inline int _be(Buffer* b, uint8_t marker, uint64_t value, int width) except -1:
    cdef int i
    _reserve(b, 1 + width)
    b.data[b.size] = <char>marker
    for i in range(width):
        b.data[b.size + 1 + i] = <char>((value >> (8 * (width - 1 - i))) & 0xFF)
    b.size += 1 + width
    return 0


cdef inline int _raw(Buffer* b, const char* text, Py_ssize_t n) except -1:
    _reserve(b, n)
    memcpy(b.data + b.size, text, n)
    b.size += n
    return 0


cdef int _header(Buffer* b, Py_ssize_t n, uint8_t fix, Py_ssize_t fix_limit, uint8_t marker16) except -1:
    if n < fix_limit:
        return _byte(b, fix | <uint8_t>n)
    if n < 0x10000:
        return _be(b, marker16, n, 2)
    return _be(b, marker16 + 1, n, 4)


cdef inline int _array(Buffer* b, Py_ssize_t n) except -1:
    return _header(b, n, 0x90, 16, 0xDC)


cdef inline int _map(Buffer* b, Py_ssize_t n) except -1:
    return _header(b, n, 0x80, 16, 0xDE)


cdef int _uint(Buffer* b, uint64_t v) except -1:
    """msgpack-python's minimal form of a non-negative integer."""
    if v < 0x80:
        return _byte(b, <uint8_t>v)
    if v < 0x100:
        return _be(b, 0xCC, v, 1)
    if v < 0x10000:
        return _be(b, 0xCD, v, 2)
    if v < 0x100000000:
        return _be(b, 0xCE, v, 4)
    return _be(b, 0xCF, v, 8)


cdef int _int(Buffer* b, object value) except -2:
    """An exact int as msgpack-python packs it; 1 (nothing written) for anything else, or out of range."""
    cdef int64_t s
    if type(value) is not int:
        return 1
    if value >= 0:
        if value > 0xFFFFFFFFFFFFFFFF:
            return 1
        _uint(b, <uint64_t>value)
        return 0
    if value < -0x8000000000000000:
        return 1
    s = value
    if s >= -32:
        _byte(b, <uint8_t>(s & 0xFF))
    elif s >= -0x80:
        _be(b, 0xD0, <uint64_t>s, 1)
    elif s >= -0x8000:
        _be(b, 0xD1, <uint64_t>s, 2)
    elif s >= -0x80000000:
        _be(b, 0xD2, <uint64_t>s, 4)
    else:
        _be(b, 0xD3, <uint64_t>s, 8)
    return 0


cdef int _str(Buffer* b, object text) except -2:
    """A str as msgpack-python packs it (use_bin_type: str8 exists); 1 when it is not one or not UTF-8."""
    cdef const char* utf8
    cdef Py_ssize_t n
    if type(text) is not str:
        return 1
    try:
        utf8 = PyUnicode_AsUTF8AndSize(text, &n)
    except UnicodeError:
        return 1
    if n < 32:
        _byte(b, 0xA0 | <uint8_t>n)
    elif n < 0x100:
        _be(b, 0xD9, n, 1)
    elif n < 0x10000:
        _be(b, 0xDA, n, 2)
    else:
        _be(b, 0xDB, n, 4)
    _raw(b, utf8, n)
    return 0


cdef inline int _key(Buffer* b, bytes key) except -1:
    """A pre-encoded map key."""
    return _raw(b, PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key))


cdef bytes _k(str name):
    encoded = name.encode()
    return bytes([0xA0 | len(encoded)]) + encoded


cdef bytes K_WORKER_ID = _k("worker_id")
cdef bytes K_STORAGE_TIER = _k("storage_tier")
cdef bytes K_RESIDENCY_DOMAIN = _k("residency_domain")
cdef bytes K_EVENT = _k("event")
cdef bytes K_EVENT_ID = _k("event_id")
cdef bytes K_DATA = _k("data")
cdef bytes K_DP_RANK = _k("dp_rank")
cdef bytes K_STATE_SOURCE = _k("state_source")
cdef bytes K_SESSION_ID = _k("session_id")
cdef bytes K_STORED = _k("stored")
cdef bytes K_PARENT_HASH = _k("parent_hash")
cdef bytes K_START_POSITION = _k("start_position")
cdef bytes K_BLOCKS = _k("blocks")
cdef bytes K_BLOCK_HASH = _k("block_hash")
cdef bytes K_TOKENS_HASH = _k("tokens_hash")
cdef bytes K_MM_EXTRA_INFO = _k("mm_extra_info")
cdef bytes K_REMOVED = _k("removed")
cdef bytes K_BLOCK_HASHES = _k("block_hashes")
cdef bytes K_CLEARED = _k("cleared")


cdef int _optional_int(Buffer* b, object value) except -2:
    if value is None:
        return _byte(b, 0xC0)
    return _int(b, value)


cdef int _event(Buffer* b, object event, dict enum_texts, list owner_text) except -2:
    """One RouterEvent's named map; 1 (declined) for anything the Python encoder must judge."""
    cdef object data = _field(event, _router_off[4]), cls = type(data)
    cdef object source = _field(event, _router_off[6]), session = _field(event, _router_off[7])
    cdef object hashes, tokens, text
    cdef Py_ssize_t i, n
    _map(b, 4 + (source is not None) + (session is not None))
    _key(b, K_WORKER_ID)
    if _int(b, _field(event, _router_off[0])):
        return 1
    for key, member in ((K_STORAGE_TIER, _field(event, _router_off[1])), (K_RESIDENCY_DOMAIN, _field(event, _router_off[2]))):
        _key(b, key)
        text = enum_texts.get(member)
        if text is None:
            text = enum_texts[member] = member.value
        if _str(b, text):
            return 1
    _key(b, K_EVENT)
    _map(b, 3)
    _key(b, K_EVENT_ID)
    if _int(b, _field(event, _router_off[3])):
        return 1
    _key(b, K_DATA)
    if cls is _stored_cls:
        if _field(data, _stored_off[3]) is not None:
            return 1  # multimodal info: the Python encoder
        hashes, tokens = _field(data, _stored_off[1]), _field(data, _stored_off[2])
        if type(hashes) is not tuple or type(tokens) is not tuple or len(hashes) != len(tokens):
            return 1
        _map(b, 1)
        _key(b, K_STORED)
        _map(b, 3)
        _key(b, K_PARENT_HASH)
        if _optional_int(b, _field(data, _stored_off[0])):
            return 1
        _key(b, K_START_POSITION)
        if _optional_int(b, _field(data, _stored_off[4])):
            return 1
        _key(b, K_BLOCKS)
        n = len(hashes)
        _array(b, n)
        for i in range(n):
            _map(b, 3)
            _key(b, K_BLOCK_HASH)
            if _int(b, hashes[i]):
                return 1
            _key(b, K_TOKENS_HASH)
            if _int(b, tokens[i]):
                return 1
            _key(b, K_MM_EXTRA_INFO)
            _byte(b, 0xC0)
    elif cls is _removed_cls:
        hashes = _field(data, _removed_off[0])
        if type(hashes) is not tuple:
            return 1
        _map(b, 1)
        _key(b, K_REMOVED)
        _map(b, 1)
        _key(b, K_BLOCK_HASHES)
        n = len(hashes)
        _array(b, n)
        for i in range(n):
            if _int(b, hashes[i]):
                return 1
    elif data is _cleared:
        _key(b, K_CLEARED)
    else:
        return 1
    _key(b, K_DP_RANK)
    if _int(b, _field(event, _router_off[5])):
        return 1
    if source is not None:
        _key(b, K_STATE_SOURCE)
        if owner_text[0] is not source:
            owner_text[0], owner_text[1] = source, str(source)
        if _str(b, owner_text[1]):
            return 1
    if session is not None:
        _key(b, K_SESSION_ID)
        if _str(b, session):
            return 1
    return 0


def encode_router_events(events):
    """``encode_router_events``'s bytes (a msgpack array of named maps, as msgpack-python packs them), or
    None when an event is not the plain shape (the Python encoder then encodes it, or raises)."""
    if not _configured:
        return None
    cdef Buffer b
    cdef dict enum_texts = {}
    cdef list owner_text = [None, None]
    b.data, b.size, b.capacity = NULL, 0, 0
    try:
        _array(&b, len(events))
        for event in events:
            if type(event) is not _router_cls or _event(&b, event, enum_texts, owner_text):
                return None
        return PyBytes_FromStringAndSize(b.data, b.size)
    finally:
        free(b.data)
