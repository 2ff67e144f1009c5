/*
 * The ceiling: a server that speaks PostgreSQL's protocol and does nothing else.
 * Logins are accepted without a password, and every query (simple, or an
 * extended Parse/Bind/Describe/Execute/Sync batch) is answered at once with the
 * same canned row. One thread, epoll, one recv and at most one send per wake:
 * the least work any server, proxy or cache can do per query. bench/run.py runs
 * pgbench against it beside the real targets in the cache-hot workloads, so the
 * report shows how close pgmemo's cache hits come to what this machine and
 * pgbench can do at all (on a 2-core machine pgbench and the kernel's loopback
 * take most of the CPU of a cached read).
 *
 *   cc -O2 -o ceiling bench/ceiling.c && ./ceiling PORT
 *
 * Not a PostgreSQL: no authentication, no errors, no cancel, no COPY; any
 * message it does not know is skipped without a reply.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAX_MESSAGE (1 << 20)

struct conn {
    int fd;
    int started;            /* the startup packet was answered */
    char *in;               /* bytes received and not yet handled */
    size_t in_len, in_cap;
};

struct out {
    char *buf;
    size_t len, cap;
};

static void put(struct out *o, const void *p, size_t n) {
    if (o->len + n > o->cap) {
        o->cap = (o->len + n) * 2;
        o->buf = realloc(o->buf, o->cap);
        if (!o->buf) { perror("realloc"); exit(1); }
    }
    memcpy(o->buf + o->len, p, n);
    o->len += n;
}

static void put_u32(struct out *o, uint32_t v) { v = htonl(v); put(o, &v, 4); }
static void put_u16(struct out *o, uint16_t v) { v = htons(v); put(o, &v, 2); }

/* A message: its tag, then the body written by the caller, then its length filled in. */
static size_t begin(struct out *o, char tag) { put(o, &tag, 1); put_u32(o, 0); return o->len - 4; }
static void end(struct out *o, size_t at) {
    uint32_t n = htonl((uint32_t)(o->len - at));
    memcpy(o->buf + at, &n, 4);
}

static void parameter_status(struct out *o, const char *name, const char *value) {
    size_t at = begin(o, 'S');
    put(o, name, strlen(name) + 1);
    put(o, value, strlen(value) + 1);
    end(o, at);
}

/* The canned result: one int4 column `abalance`, one row holding 1 (`SELECT 1` checks it). */
static void row_description(struct out *o) {
    size_t at = begin(o, 'T');
    put_u16(o, 1);
    put(o, "abalance", 9);
    put_u32(o, 0);            /* table oid */
    put_u16(o, 0);            /* column number */
    put_u32(o, 23);           /* int4 */
    put_u16(o, 4);            /* type size */
    put_u32(o, 0xffffffff);   /* type modifier -1 */
    put_u16(o, 0);            /* text format */
    end(o, at);
}

static void rows(struct out *o) {
    size_t at = begin(o, 'D');
    put_u16(o, 1);
    put_u32(o, 1);
    put(o, "1", 1);
    end(o, at);
    at = begin(o, 'C');
    put(o, "SELECT 1", 9);
    end(o, at);
}

static void ready(struct out *o) {
    size_t at = begin(o, 'Z');
    put(o, "I", 1);
    end(o, at);
}

static void empty(struct out *o, char tag) { end(o, begin(o, tag)); }

static void login(struct out *o) {
    size_t at = begin(o, 'R');
    put_u32(o, 0);            /* AuthenticationOk */
    end(o, at);
    parameter_status(o, "server_version", "17.0");
    parameter_status(o, "server_encoding", "UTF8");
    parameter_status(o, "client_encoding", "UTF8");
    parameter_status(o, "DateStyle", "ISO, MDY");
    parameter_status(o, "integer_datetimes", "on");
    parameter_status(o, "standard_conforming_strings", "on");
    at = begin(o, 'K');
    put_u32(o, 1);
    put_u32(o, 1);
    end(o, at);
    ready(o);
}

static void send_all(int fd, const char *p, size_t n) {
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w > 0) { p += w; n -= (size_t)w; continue; }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && errno == EAGAIN) {
            /* The client does not read: wait for it (only ever the benchmark's own client). */
            struct epoll_event ev = {.events = EPOLLOUT};
            int ep = epoll_create1(0);
            epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
            epoll_wait(ep, &ev, 1, 1000);
            close(ep);
            continue;
        }
        return; /* gone: its next read says so */
    }
}

/* Handles every whole message in c->in; returns 0 when the connection must close. */
static int handle(struct conn *c, struct out *o) {
    size_t at = 0;
    int open = 1;
    while (open) {
        size_t left = c->in_len - at;
        const unsigned char *m = (const unsigned char *)c->in + at;
        if (!c->started) {
            if (left < 8) break;
            uint32_t len = ntohl(*(const uint32_t *)m), code = ntohl(*(const uint32_t *)(m + 4));
            if (len < 8 || len > MAX_MESSAGE) return 0;
            if (left < len) break;
            at += len;
            if (code == 80877103 || code == 80877104) {       /* SSLRequest, GSSENCRequest */
                put(o, "N", 1);
            } else if (code == 196608) {                        /* protocol 3.0 */
                c->started = 1;
                login(o);
            } else {
                open = 0;                                       /* a cancel, or unknown */
            }
            continue;
        }
        if (left < 5) break;
        uint32_t len = ntohl(*(const uint32_t *)(m + 1));
        if (len < 4 || len > MAX_MESSAGE) return 0;
        if (left < 1 + (size_t)len) break;
        at += 1 + len;
        switch (m[0]) {
        case 'Q': row_description(o); rows(o); ready(o); break;
        case 'P': empty(o, '1'); break;
        case 'B': empty(o, '2'); break;
        case 'D':
            if (len > 4 && m[5] == 'S') {
                size_t p = begin(o, 't');
                put_u16(o, 0);
                end(o, p);
            }
            row_description(o);
            break;
        case 'E': rows(o); break;
        case 'S': ready(o); break;
        case 'C': empty(o, '3'); break;
        case 'X': open = 0; break;
        default: break;                                         /* Flush and the rest */
        }
    }
    memmove(c->in, c->in + at, c->in_len - at);
    c->in_len -= at;
    return open;
}

int main(int argc, char **argv) {
    if (argc != 2) { fprintf(stderr, "usage: %s PORT\n", argv[0]); return 2; }
    int one = 1, ls = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(argv[1]))};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(ls, (struct sockaddr *)&a, sizeof a) || listen(ls, 1024)) { perror("ceiling: listen"); return 1; }
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(ep, EPOLL_CTL_ADD, ls, &ev);
    struct out o = {0};
    struct epoll_event evs[256];
    for (;;) {
        int n = epoll_wait(ep, evs, 256, -1);
        if (n < 0 && errno == EINTR) continue;
        for (int i = 0; i < n; i++) {
            struct conn *c = evs[i].data.ptr;
            if (c == NULL) {
                int fd;
                while ((fd = accept4(ls, NULL, NULL, SOCK_NONBLOCK)) >= 0) {
                    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                    c = calloc(1, sizeof *c);
                    c->fd = fd;
                    c->in_cap = 8192;
                    c->in = malloc(c->in_cap);
                    struct epoll_event e = {.events = EPOLLIN, .data.ptr = c};
                    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &e);
                }
                continue;
            }
            if (c->in_len == c->in_cap) {
                c->in_cap *= 2;
                c->in = realloc(c->in, c->in_cap);
            }
            ssize_t r = recv(c->fd, c->in + c->in_len, c->in_cap - c->in_len, 0);
            if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
            int open = r > 0;
            o.len = 0;
            if (open) {
                c->in_len += (size_t)r;
                open = handle(c, &o);
                if (o.len) send_all(c->fd, o.buf, o.len);
            }
            if (!open) {
                close(c->fd);
                free(c->in);
                free(c);
            }
        }
    }
}
