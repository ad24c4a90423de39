/* An LD_PRELOAD shim for tests/power_loss.rs: every successful fsync/fdatasync appends
 * "<size> <path>" to $POWERLOSS_LOG, the size the file had when the sync began (what the sync
 * made durable: bytes written after it began may not be). After a kill -9 the test cuts every
 * file back to its last synced size, losing what a power cut would. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

static void record(int fd, long long size) {
    const char *log = getenv("POWERLOSS_LOG");
    if (!log || size < 0) return;
    char link[64], path[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n < 0) return;
    path[n] = 0;
    char line[4200];
    int len = snprintf(line, sizeof line, "%lld %s\n", size, path);
    int out = open(log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
    if (out < 0) return;
    if (write(out, line, (size_t)len) < 0) { /* the test sees the gap */ }
    close(out);
}

static long long size_of(int fd) {
    struct stat st;
    return fstat(fd, &st) == 0 ? (long long)st.st_size : -1;
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    long long size = size_of(fd);
    int r = real(fd);
    if (r == 0) record(fd, size);
    return r;
}

int fsync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    long long size = size_of(fd);
    int r = real(fd);
    if (r == 0) record(fd, size);
    return r;
}
