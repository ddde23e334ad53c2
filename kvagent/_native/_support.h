/* C helpers of kvagent/_native/_ingest.pyx: xxh3 inlined, and value objects built from their slot offsets. */
#ifndef KVAGENT_NATIVE_SUPPORT_H
#define KVAGENT_NATIVE_SUPPORT_H

#include <Python.h>
#include <structmember.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

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
