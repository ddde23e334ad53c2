/* C helpers of kvagent/_native/_ingest.pyx: XXH3 from the system's libxxhash when setup.py found it, and value
 * objects built from their slot offsets. */
#ifndef KVAGENT_NATIVE_SUPPORT_H
#define KVAGENT_NATIVE_SUPPORT_H

#include <Python.h>
#include <structmember.h>

#ifdef KVAGENT_SYSTEM_XXHASH
/* setup.py found libxxhash's header (Debian: libxxhash-dev) and defines this. XXH_INLINE_ALL compiles the
 * library's XXH3 into the extension from that header: the per-block hash (64 bytes at block size 16) stays
 * inlined, and the built extension needs no libxxhash at run time (the container's runtime stage). */
#define XXH_INLINE_ALL
#include <xxhash.h>
#define KV_SYSTEM_XXH3 1
#else
/* No libxxhash at build time: _ingest.pyx calls the xxhash package's xxh3_64_intdigest instead (this stub is
 * never called; KV_SYSTEM_XXH3 tells the call site which to use). */
#include <stdint.h>
static inline uint64_t XXH3_64bits_withSeed(const void *data, size_t length, uint64_t seed)
{
    (void)data;
    (void)length;
    return seed;
}
#define KV_SYSTEM_XXH3 0
#endif

/* The byte offset of a slotted class's member (a __slots__ entry), or -1 when ``descr`` is not one. */
static Py_ssize_t kv_member_offset(PyObject *descr)
{
    if (Py_TYPE(descr) != &PyMemberDescr_Type) {
        return -1;
    }
    PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
    if (member->type != T_OBJECT_EX || (member->flags & READONLY)) {
        return -1;
    }
    return member->offset;
}

/* A new, empty instance of a slotted class (its members NULL), as type.__new__ would allocate it. */
static PyObject *kv_alloc(PyTypeObject *type)
{
    return type->tp_alloc(type, 0);
}

/* Store a new reference to ``value`` in the (still NULL) member at ``offset`` of a freshly allocated object. */
static void kv_set(PyObject *object, Py_ssize_t offset, PyObject *value)
{
    Py_INCREF(value);
    *(PyObject **)((char *)object + offset) = value;
}

/* The member at ``offset`` (borrowed; the caller has checked the object's exact type). */
static PyObject *kv_get(PyObject *object, Py_ssize_t offset)
{
    return *(PyObject **)((char *)object + offset);
}

#endif
