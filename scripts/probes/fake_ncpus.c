/* What XLA:CPU compiles on a host of N cores, read on this one: an LD_PRELOAD shim whose
 * sched_getaffinity reports CPUs 0..N-1 (N = $FAKE_NCPUS; unset or empty: the real mask).
 * tsl::port::NumSchedulableCPUs() counts that mask, and XLA:CPU sizes its tasks per loop
 * (ParallelTaskAssigner: at most ceil(sqrt(N)) for a loop that moves more bytes than it
 * computes flops) and its thread pool from it. Only the compiled program is the N-core
 * host's: the times are this machine's cores, oversubscribed.
 *
 *   gcc -shared -fPIC -O2 -o /tmp/fake_ncpus.so scripts/probes/fake_ncpus.c -ldl
 *   FAKE_NCPUS=16 LD_PRELOAD=/tmp/fake_ncpus.so PYTHONPATH=. \
 *       python scripts/probes/probe_host_adamw.py --structure-only --sizes 6.4e7 --leaf 3.2e7
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

int sched_getaffinity(pid_t pid, size_t setsize, cpu_set_t *mask) {
  const char *n = getenv("FAKE_NCPUS");
  if (n == NULL || *n == '\0') {
    int (*real)(pid_t, size_t, cpu_set_t *) = dlsym(RTLD_NEXT, "sched_getaffinity");
    return real(pid, setsize, mask);
  }
  memset(mask, 0, setsize);
  for (int cpu = 0; cpu < atoi(n) && (size_t)cpu < 8 * setsize; cpu++) CPU_SET_S(cpu, setsize, mask);
  return 0;
}
