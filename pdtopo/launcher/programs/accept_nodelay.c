/* Preloaded into the Rust router (proxy.kind=rust) by pdtopo.launcher.programs.nodelay_exec.
 *
 * sglang-router 0.3.2 leaves Nagle's algorithm on for the client connections it accepts, so the
 * small write of a stream's first event waits for the client's delayed acknowledgement (up to
 * 40 ms on Linux) on a reused keep-alive connection (docs/observability.md). This library wraps
 * accept() and accept4(): every TCP socket they return gets TCP_NODELAY; anything else (Unix
 * sockets, errors) passes through untouched, and the caller sees the same return value and errno.
 *
 * At load it removes its own file (and the private directory it was built in) and puts
 * LD_PRELOAD back as it was, so nothing is left on disk and the router's children, if any, do not
 * inherit it. nodelay_exec passes both through the environment:
 *   PDTOPO_NODELAY_SO            the path of this file
 *   PDTOPO_NODELAY_PRELOAD_WAS   LD_PRELOAD before nodelay_exec prepended this file ("" = unset)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <libgen.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static int (*next_accept4)(int, struct sockaddr *, socklen_t *, int);
static int (*next_accept)(int, struct sockaddr *, socklen_t *);

/* The real functions, found once when the library loads (before any thread runs). */
static void find_next(void) {
    if (!next_accept4) next_accept4 = dlsym(RTLD_NEXT, "accept4");
    if (!next_accept) next_accept = dlsym(RTLD_NEXT, "accept");
}

/* Counted for the tests (read with dlsym through the process's own handle). */
unsigned long pdtopo_nodelay_sockets = 0;

static void set_nodelay(int fd) {
    int saved = errno;
    int type = 0;
    socklen_t len = sizeof type;
    struct sockaddr_storage name;
    socklen_t name_len = sizeof name;
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) == 0 && type == SOCK_STREAM &&
        getsockname(fd, (struct sockaddr *)&name, &name_len) == 0 &&
        (name.ss_family == AF_INET || name.ss_family == AF_INET6)) {
        int one = 1;
        if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) == 0)
            __atomic_add_fetch(&pdtopo_nodelay_sockets, 1, __ATOMIC_RELAXED);
    }
    errno = saved;
}

int accept4(int sockfd, struct sockaddr *addr, socklen_t *addrlen, int flags) {
    if (!next_accept4) find_next();
    if (!next_accept4) { errno = ENOSYS; return -1; }
    int fd = next_accept4(sockfd, addr, addrlen, flags);
    if (fd >= 0) set_nodelay(fd);
    return fd;
}

int accept(int sockfd, struct sockaddr *addr, socklen_t *addrlen) {
    if (!next_accept) find_next();
    if (!next_accept) { errno = ENOSYS; return -1; }
    int fd = next_accept(sockfd, addr, addrlen);
    if (fd >= 0) set_nodelay(fd);
    return fd;
}

__attribute__((constructor)) static void forget_own_file(void) {
    find_next();
    const char *path = getenv("PDTOPO_NODELAY_SO");
    const char *was = getenv("PDTOPO_NODELAY_PRELOAD_WAS");
    Dl_info self;
    /* only ever this library's own file: a stray PDTOPO_NODELAY_SO names nothing to delete */
    if (path && *path && dladdr((void *)forget_own_file, &self) && self.dli_fname &&
        strcmp(self.dli_fname, path) == 0) {
        char dir[4096];
        strncpy(dir, path, sizeof dir - 1);
        dir[sizeof dir - 1] = '\0';
        unlink(path);
        rmdir(dirname(dir));
    }
    if (was) {
        if (*was) setenv("LD_PRELOAD", was, 1);
        else unsetenv("LD_PRELOAD");
    }
    unsetenv("PDTOPO_NODELAY_SO");
    unsetenv("PDTOPO_NODELAY_PRELOAD_WAS");
}
