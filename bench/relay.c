/*
 * The relay floor: the least work a proxy can do per query. Each client connection gets a
 * connection of its own to PostgreSQL, and bytes are copied both ways as they come: one
 * thread, epoll, one read and one write per wake, TCP_NODELAY on both sides, no parsing, no
 * pooling, no login of its own (the client logs into PostgreSQL through it). bench/run.py
 * runs pgbench through it beside the real targets in the forwarding rows, so the report shows
 * what any proxy costs on this machine before it does anything at all: the kernel's two extra
 * sends, two extra reads and two extra wake-ups a transaction. At one client that is most of
 * what every proxy adds to PostgreSQL's latency.
 *
 *   cc -O2 -o relay bench/relay.c && ./relay LISTEN_PORT UPSTREAM_PORT
 *
 * For benchmarks only: sockets are blocking, so a write that cannot be taken at once (a
 * client that does not read a large result) stalls every connection until it is; a failed
 * upstream connect closes the client without a word.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAX_FD 65536

/* The other end of each connection, by descriptor. */
static int peer[MAX_FD];

static struct sockaddr_in loopback(int port) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return a;
}

static void nodelay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static void watch(int ep, int fd) {
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = fd};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev)) { perror("relay: epoll_ctl"); exit(1); }
}

/* A client accepted: its own upstream connection, both watched. */
static void open_pair(int ep, int listener, const struct sockaddr_in *upstream) {
    int c = accept(listener, NULL, NULL);
    if (c < 0) return;
    int u = socket(AF_INET, SOCK_STREAM, 0);
    if (u < 0 || c >= MAX_FD || u >= MAX_FD
        || connect(u, (const struct sockaddr *)upstream, sizeof *upstream)) {
        close(c);
        if (u >= 0) close(u);
        return;
    }
    nodelay(c);
    nodelay(u);
    peer[c] = u;
    peer[u] = c;
    watch(ep, c);
    watch(ep, u);
}

/* Bytes readable on fd: passed to its peer whole. False: the pair is done. */
static int relay(int fd, char *buf, size_t cap) {
    ssize_t n;
    do n = recv(fd, buf, cap, MSG_DONTWAIT); while (n < 0 && errno == EINTR);
    /* Nothing after all (an event of a descriptor closed and reused in the same wake). */
    if (n < 0 && errno == EAGAIN) return 1;
    if (n <= 0) return 0;
    for (ssize_t off = 0; off < n;) {
        ssize_t w = send(peer[fd], buf + off, (size_t)(n - off), MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return 0;
        off += w;
    }
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: relay LISTEN_PORT UPSTREAM_PORT\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    struct sockaddr_in listen_at = loopback(atoi(argv[1]));
    struct sockaddr_in upstream = loopback(atoi(argv[2]));
    int listener = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(listener, (struct sockaddr *)&listen_at, sizeof listen_at) || listen(listener, 1024)) {
        perror("relay: listen");
        return 1;
    }
    int ep = epoll_create1(0);
    watch(ep, listener);
    static char buf[1 << 16];
    struct epoll_event events[256];
    for (;;) {
        int n = epoll_wait(ep, events, 256, -1);
        if (n < 0 && errno != EINTR) { perror("relay: epoll_wait"); return 1; }
        for (int i = 0; i < n; i++) {
            int fd = events[i].data.fd;
            if (fd == listener) {
                open_pair(ep, listener, &upstream);
            } else if (peer[fd] >= 0 && !relay(fd, buf, sizeof buf)) {
                /* Closing both takes them out of epoll; a later event of this wake for the
                 * peer finds it marked. */
                int p = peer[fd];
                close(fd);
                close(p);
                peer[fd] = peer[p] = -1;
            }
        }
    }
}
