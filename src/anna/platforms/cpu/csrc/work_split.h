/* How a matmul's units of work (blocks of output rows) are shared among the OpenMP threads.
 *
 * Each thread owns a contiguous range of units and takes it a chunk at a time; a thread done with
 * its own range then takes the chunks left in the others'. With fixed ranges alone, a vCPU that
 * loses its host core for a while makes the other threads wait at the end of every matmul (int4
 * layer matmuls of a decode step at 16 rows: 1.07-1.15x faster than fixed ranges on a 2-vCPU VM).
 * Chunks keep each thread's weight stream contiguous: single units claimed from one shared counter
 * interleave the threads' streams and measured 0.72-0.82x.
 *
 * Use: declare `split_range ranges[SPLIT_MAX_THREADS]` outside the parallel region, call
 * split_start in every thread, then a barrier, then loop on split_next. */
#ifndef ANNA_WORK_SPLIT_H
#define ANNA_WORK_SPLIT_H

#define SPLIT_MAX_THREADS 256
#define SPLIT_CHUNKS_PER_THREAD 32  /* 8 and 16 measured 3-8% slower at 16 rows, 64 the same */

typedef struct {
    long next;  /* the range's first unclaimed unit */
} __attribute__((aligned(64))) split_range;  /* one cache line per range */

static inline long split_per_thread(long units, int nt) { return (units + nt - 1) / nt; }

static inline void split_start(split_range *ranges, long units, int t, int nt) {
    long first = t * split_per_thread(units, nt);
    ranges[t].next = first < units ? first : units;
}

/* The next chunk [*b, *e) for thread t; `*visited` (0 at first) counts the ranges already emptied.
 * Returns 0 when every range is done. */
static inline int split_next(split_range *ranges, long units, int t, int nt, int *visited, long *b, long *e) {
    long per = split_per_thread(units, nt), chunk = (per + SPLIT_CHUNKS_PER_THREAD - 1) / SPLIT_CHUNKS_PER_THREAD;
    if (chunk < 1) chunk = 1;
    for (; *visited < nt; (*visited)++) {
        int owner = (t + *visited) % nt;
        long end = (owner + 1) * per < units ? (owner + 1) * per : units;
        long u = __atomic_fetch_add(&ranges[owner].next, chunk, __ATOMIC_RELAXED);
        if (u < end) {
            *b = u;
            *e = u + chunk < end ? u + chunk : end;
            return 1;
        }
    }
    return 0;
}

#endif
