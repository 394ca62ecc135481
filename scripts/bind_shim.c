/* pd_bind_shim: make Mooncake's listeners bind to the stage's bootstrap_host.
 *
 * mooncake-transfer-engine 0.3.13 binds its TCP data-plane and handshake listeners to the
 * wildcard address (0.0.0.0 / [::]) whatever MC_TCP_BIND_ADDRESS says (checked with ss and
 * /proc/net/tcp on a running engine), so any host that reaches the machine could read or write
 * the KV pools. Preloaded into the serving processes (scripts/bind_env.sh), this library turns a
 * wildcard bind() of a TCP socket to a port in Mooncake's port range [MC_MIN_RPC_PORT,
 * MC_MAX_RPC_PORT] (default 15000..17000) into a bind to PD_BIND_ADDR, which kvtransfer sets
 * from bootstrap_host before it starts the engine. Every other bind() is passed through as is:
 * explicit addresses (Triton's ports, the zmq control sockets), other ports, UDP, and all binds
 * while PD_BIND_ADDR is unset.
 *
 * Built by scripts/setup.sh:  cc -shared -fPIC -O2 -o .venv/lib/pd_bind_shim.so bind_shim.c -ldl
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static long env_long(const char *name, long fallback) {
    const char *v = getenv(name);
    char *end;
    long n = v ? strtol(v, &end, 10) : 0;
    return v && *v && !*end ? n : fallback;
}

static int in_mooncake_range(int port) {
    return port >= env_long("MC_MIN_RPC_PORT", 15000) && port <= env_long("MC_MAX_RPC_PORT", 17000);
}

static int is_stream(int fd) {
    int type = 0;
    socklen_t n = sizeof type;
    return getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &n) == 0 && type == SOCK_STREAM;
}

/* the wildcard IPv6 address -> `want` (an IPv4 target becomes the v4-mapped ::ffff:a.b.c.d) */
static int to_v6(struct sockaddr_in6 *a, const char *want) {
    struct in_addr v4;
    if (inet_pton(AF_INET, want, &v4) == 1) {
        memset(&a->sin6_addr, 0, sizeof a->sin6_addr);
        a->sin6_addr.s6_addr[10] = 0xff;
        a->sin6_addr.s6_addr[11] = 0xff;
        memcpy(&a->sin6_addr.s6_addr[12], &v4, sizeof v4);
        return 1;
    }
    return inet_pton(AF_INET6, want, &a->sin6_addr) == 1;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind;
    if (!real_bind) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    const char *want = getenv("PD_BIND_ADDR");
    if (!want || !*want || !addr || !is_stream(fd)) return real_bind(fd, addr, len);
    if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in a = *(const struct sockaddr_in *)addr;
        if (a.sin_addr.s_addr != htonl(INADDR_ANY) || !in_mooncake_range(ntohs(a.sin_port)))
            return real_bind(fd, addr, len);
        if (inet_pton(AF_INET, want, &a.sin_addr) != 1) {
            errno = EADDRNOTAVAIL; /* an IPv6 bootstrap_host on an IPv4 socket: refuse */
            return -1;
        }
        return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
    }
    if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a = *(const struct sockaddr_in6 *)addr;
        if (!IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr) || !in_mooncake_range(ntohs(a.sin6_port)))
            return real_bind(fd, addr, len);
        if (!to_v6(&a, want)) {
            errno = EADDRNOTAVAIL;
            return -1;
        }
        return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
    }
    return real_bind(fd, addr, len);
}
