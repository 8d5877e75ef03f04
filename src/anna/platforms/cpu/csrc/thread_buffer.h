/* Per-thread scratch buffers that live from one kernel call to the next.
 *
 * A buffer of megabytes allocated per call is mapped afresh whenever malloc hands it to mmap, and
 * each of its pages then faults on first write: a 512-token prefill's matmuls ran 1.2x slower once
 * other code had left malloc that way. Each translation unit that includes this header has its own
 * slots (they are static), so a kernel file numbers its buffers from 0. */
#ifndef ANNA_THREAD_BUFFER_H
#define ANNA_THREAD_BUFFER_H

#include <stddef.h>
#include <stdlib.h>

#define THREAD_BUFFER_SLOTS 4

/* A 64-byte-aligned buffer of at least `bytes` in slot `slot` of the calling thread: the same
 * memory as its last call with this slot wherever that was large enough. */
static inline void *thread_buffer(int slot, size_t bytes) {
    static __thread void *buffers[THREAD_BUFFER_SLOTS];
    static __thread size_t sizes[THREAD_BUFFER_SLOTS];
    if (sizes[slot] < bytes) {
        free(buffers[slot]);
        sizes[slot] = (bytes + 63) / 64 * 64;
        buffers[slot] = aligned_alloc(64, sizes[slot]);
    }
    return buffers[slot];
}

#endif
