/* Sends or receives UDP datagrams on a veth as fast as one thread can, by
 * one carrier, for bench/carriers.py: AF_XDP (copy mode, libxdp's xsk API)
 * against the UDP socket vnetd uses (sendmmsg, UDP GSO runs, UDP GRO).
 * A benchmark tool, not part of vnetd.
 *
 *   carrier tx-xsk  <ifname> <src-mac> <dst-mac> <src-ip> <dst-ip> <port> <payload> <seconds>
 *   carrier tx-gso  <src-ip> <dst-ip> <port> <payload> <seconds>   GSO runs (UDP_SEGMENT), 4 per sendmmsg
 *   carrier tx-mmsg <src-ip> <dst-ip> <port> <payload> <seconds>   64 datagrams per sendmmsg, no GSO
 *   carrier rx-xsk  <ifname> <seconds>                             every frame of queue 0 (libxdp's program)
 *   carrier rx-gro  <port> <seconds>                               recvmmsg of 16, UDP_GRO
 *
 * Prints one JSON line: {"mode": .., "frames": .., "seconds": ..}; frames
 * are datagrams put on the wire (tx: what the kernel took) or received
 * (rx: GRO runs counted as their segments).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/udp.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>
#include <xdp/xsk.h>

#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif

#define BATCH 64
#define NFRAMES 4096
#define FRAME 4096

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static void die(const char *what, int err) {
    fprintf(stderr, "carrier: %s: %s\n", what, strerror(err));
    exit(1);
}

static void report(const char *mode, unsigned long long frames, double secs) {
    printf("{\"mode\": \"%s\", \"frames\": %llu, \"seconds\": %.3f}\n", mode, frames, secs);
}

static void mac(const char *s, uint8_t *out) {
    if (sscanf(s, "%hhx:%hhx:%hhx:%hhx:%hhx:%hhx", &out[0], &out[1], &out[2], &out[3], &out[4], &out[5]) != 6) {
        fprintf(stderr, "carrier: bad MAC %s\n", s);
        exit(2);
    }
}

static uint16_t csum(const void *p, int len) {
    const uint16_t *w = p;
    uint32_t s = 0;
    for (; len > 1; len -= 2) s += *w++;
    if (len) s += *(const uint8_t *)w;
    while (s >> 16) s = (s & 0xffff) + (s >> 16);
    return ~s;
}

struct xsk {
    struct xsk_umem *umem;
    struct xsk_socket *sock;
    struct xsk_ring_prod fill, tx;
    struct xsk_ring_cons comp, rx;
    void *area;
};

static void xsk_open(struct xsk *x, const char *ifname, int rx) {
    x->area = mmap(NULL, (size_t)NFRAMES * FRAME, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (x->area == MAP_FAILED) die("mmap", errno);
    struct xsk_umem_config uc = {.fill_size = NFRAMES / 2, .comp_size = NFRAMES / 2, .frame_size = FRAME};
    int e = xsk_umem__create(&x->umem, x->area, (uint64_t)NFRAMES * FRAME, &x->fill, &x->comp, &uc);
    if (e) die("xsk_umem__create", -e);
    struct xsk_socket_config sc = {.rx_size = NFRAMES / 2, .tx_size = NFRAMES / 2, .xdp_flags = 2 /* XDP_FLAGS_SKB_MODE */,
                                   .bind_flags = 1 << 1 /* XDP_COPY */};
    if (!rx) sc.libxdp_flags = 1; /* XSK_LIBXDP_FLAGS__INHIBIT_PROG_LOAD: transmit only */
    /* The queue stays busy for a moment after the last socket on it closed. */
    for (int tries = 0; tries < 50; tries++) {
        e = xsk_socket__create(&x->sock, ifname, 0, x->umem, rx ? &x->rx : NULL, rx ? NULL : &x->tx, &sc);
        if (e != -EBUSY) break;
        usleep(100 * 1000);
    }
    if (e) die("xsk_socket__create", -e);
}

static void xsk_close(struct xsk *x) {
    xsk_socket__delete(x->sock); /* and the XDP program libxdp loaded for it */
    xsk_umem__delete(x->umem);
}

static int tx_xsk(char **a) {
    struct xsk x;
    uint8_t smac[6], dmac[6];
    mac(a[1], smac);
    mac(a[2], dmac);
    int payload = atoi(a[6]);
    double secs = atof(a[7]);
    int len = 14 + 20 + 8 + payload;
    if (len > FRAME) die("payload", EMSGSIZE);
    xsk_open(&x, a[0], 0);
    /* Every frame the same datagram, built once in each umem frame. */
    uint8_t f[FRAME];
    memset(f, 0, sizeof f);
    memcpy(f, dmac, 6);
    memcpy(f + 6, smac, 6);
    f[12] = 0x08;
    struct iphdr *ip = (struct iphdr *)(f + 14);
    ip->version = 4;
    ip->ihl = 5;
    ip->ttl = 64;
    ip->protocol = IPPROTO_UDP;
    ip->tot_len = htons(20 + 8 + payload);
    inet_pton(AF_INET, a[3], &ip->saddr);
    inet_pton(AF_INET, a[4], &ip->daddr);
    ip->check = csum(ip, 20);
    struct udphdr *u = (struct udphdr *)(f + 34);
    u->source = htons(atoi(a[5]));
    u->dest = htons(atoi(a[5]));
    u->len = htons(8 + payload);
    for (int i = 0; i < NFRAMES / 2; i++) memcpy((uint8_t *)x.area + (size_t)i * FRAME, f, len);
    unsigned long long sent = 0;
    uint32_t next = 0;
    double t0 = now(), end = t0 + secs;
    while (now() < end) {
        uint32_t idx, k = xsk_ring_prod__reserve(&x.tx, BATCH, &idx);
        for (uint32_t i = 0; i < k; i++) {
            struct xdp_desc *d = xsk_ring_prod__tx_desc(&x.tx, idx + i);
            d->addr = (uint64_t)(next++ % (NFRAMES / 2)) * FRAME;
            d->len = len;
        }
        xsk_ring_prod__submit(&x.tx, k);
        if (sendto(xsk_socket__fd(x.sock), NULL, 0, MSG_DONTWAIT, NULL, 0) < 0 && errno != EAGAIN && errno != EBUSY &&
            errno != ENOBUFS)
            die("sendto (kick)", errno);
        uint32_t cidx, c = xsk_ring_cons__peek(&x.comp, NFRAMES / 2, &cidx);
        xsk_ring_cons__release(&x.comp, c);
        sent += c;
    }
    report("tx-xsk", sent, now() - t0);
    xsk_close(&x);
    return 0;
}

static int udp_socket(const char *src, const char *dst, int port, struct sockaddr_in *to) {
    int s = socket(AF_INET, SOCK_DGRAM, 0);
    if (s < 0) die("socket", errno);
    struct sockaddr_in me = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, src, &me.sin_addr);
    if (bind(s, (struct sockaddr *)&me, sizeof me)) die("bind", errno);
    *to = (struct sockaddr_in){.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, dst, &to->sin_addr);
    int big = 8 << 20;
    setsockopt(s, SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
    return s;
}

static int tx_socket(char **a, int gso) {
    struct sockaddr_in to;
    int payload = atoi(a[3]);
    double secs = atof(a[4]);
    int s = udp_socket(a[0], a[1], atoi(a[2]), &to);
    static char buf[BATCH * 9000];
    if (payload > 9000) die("payload", EMSGSIZE);
    unsigned long long sent = 0;
    double t0 = now(), end = t0 + secs;
    if (gso) {
        /* As vnetd: runs of at most 64 segments and 65,000 bytes, each one
         * message with UDP_SEGMENT, four runs per sendmmsg. */
        int seg = payload, k = 65000 / payload < BATCH ? 65000 / payload : BATCH;
        if (setsockopt(s, SOL_UDP, UDP_SEGMENT, &seg, sizeof seg)) die("UDP_SEGMENT", errno);
        struct mmsghdr m[4];
        struct iovec v[4];
        for (int i = 0; i < 4; i++) {
            v[i] = (struct iovec){buf, (size_t)payload * k};
            m[i] = (struct mmsghdr){.msg_hdr = {.msg_name = &to, .msg_namelen = sizeof to, .msg_iov = &v[i], .msg_iovlen = 1}};
        }
        while (now() < end) {
            int n = sendmmsg(s, m, 4, 0);
            if (n > 0) sent += (unsigned long long)n * k;
            else if (errno != EAGAIN && errno != ENOBUFS) die("sendmmsg", errno);
        }
    } else {
        struct mmsghdr m[BATCH];
        struct iovec v[BATCH];
        for (int i = 0; i < BATCH; i++) {
            v[i] = (struct iovec){buf + (size_t)i * payload, payload};
            m[i] = (struct mmsghdr){.msg_hdr = {.msg_name = &to, .msg_namelen = sizeof to, .msg_iov = &v[i], .msg_iovlen = 1}};
        }
        while (now() < end) {
            int n = sendmmsg(s, m, BATCH, 0);
            if (n > 0) sent += n;
            else if (errno != EAGAIN && errno != ENOBUFS) die("sendmmsg", errno);
        }
    }
    report(gso ? "tx-gso" : "tx-mmsg", sent, now() - t0);
    return 0;
}

static int rx_xsk(char **a) {
    struct xsk x;
    double secs = atof(a[1]);
    xsk_open(&x, a[0], 1);
    uint32_t idx;
    uint32_t k = xsk_ring_prod__reserve(&x.fill, NFRAMES / 2, &idx);
    for (uint32_t i = 0; i < k; i++) *xsk_ring_prod__fill_addr(&x.fill, idx + i) = (uint64_t)i * FRAME;
    xsk_ring_prod__submit(&x.fill, k);
    unsigned long long got = 0;
    struct pollfd p = {.fd = xsk_socket__fd(x.sock), .events = POLLIN};
    double t0 = now(), end = t0 + secs;
    while (now() < end) {
        uint32_t ridx, n = xsk_ring_cons__peek(&x.rx, BATCH, &ridx);
        if (!n) {
            poll(&p, 1, 10);
            continue;
        }
        uint32_t fidx;
        while (xsk_ring_prod__reserve(&x.fill, n, &fidx) != n) {
        }
        for (uint32_t i = 0; i < n; i++) {
            const struct xdp_desc *d = xsk_ring_cons__rx_desc(&x.rx, ridx + i);
            volatile uint8_t touch = *((uint8_t *)xsk_umem__get_data(x.area, d->addr) + 14); /* read it, as a carrier would */
            (void)touch;
            *xsk_ring_prod__fill_addr(&x.fill, fidx + i) = xsk_umem__extract_addr(d->addr);
        }
        xsk_ring_prod__submit(&x.fill, n);
        xsk_ring_cons__release(&x.rx, n);
        got += n;
    }
    report("rx-xsk", got, now() - t0);
    xsk_close(&x);
    return 0;
}

static int rx_gro(char **a) {
    int s = socket(AF_INET, SOCK_DGRAM, 0);
    if (s < 0) die("socket", errno);
    struct sockaddr_in me = {.sin_family = AF_INET, .sin_port = htons(atoi(a[0]))};
    if (bind(s, (struct sockaddr *)&me, sizeof me)) die("bind", errno);
    int one = 1, big = 8 << 20;
    if (setsockopt(s, SOL_UDP, UDP_GRO, &one, sizeof one)) die("UDP_GRO", errno);
    setsockopt(s, SOL_SOCKET, SO_RCVBUF, &big, sizeof big);
    struct timeval tv = {0, 100 * 1000}; /* recvmmsg's own timeout is checked only after a datagram */
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    double secs = atof(a[1]);
    enum { N = 16 };
    static char bufs[N][65536];
    char ctl[N][64];
    struct mmsghdr m[N];
    struct iovec v[N];
    unsigned long long got = 0;
    double t0 = now(), end = t0 + secs;
    while (now() < end) {
        for (int i = 0; i < N; i++) {
            v[i] = (struct iovec){bufs[i], sizeof bufs[i]};
            m[i] = (struct mmsghdr){.msg_hdr = {.msg_iov = &v[i], .msg_iovlen = 1, .msg_control = ctl[i], .msg_controllen = sizeof ctl[i]}};
        }
        int n = recvmmsg(s, m, N, MSG_WAITFORONE, NULL);
        for (int i = 0; i < n; i++) {
            int seg = 0;
            for (struct cmsghdr *c = CMSG_FIRSTHDR(&m[i].msg_hdr); c; c = CMSG_NXTHDR(&m[i].msg_hdr, c))
                if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO) seg = *(int *)CMSG_DATA(c);
            got += seg ? (m[i].msg_len + seg - 1) / seg : 1;
        }
    }
    report("rx-gro", got, now() - t0);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 10 && !strcmp(argv[1], "tx-xsk")) return tx_xsk(argv + 2);
    if (argc >= 7 && !strcmp(argv[1], "tx-gso")) return tx_socket(argv + 2, 1);
    if (argc >= 7 && !strcmp(argv[1], "tx-mmsg")) return tx_socket(argv + 2, 0);
    if (argc >= 4 && !strcmp(argv[1], "rx-xsk")) return rx_xsk(argv + 2);
    if (argc >= 4 && !strcmp(argv[1], "rx-gro")) return rx_gro(argv + 2);
    fprintf(stderr, "usage: see the head of bench/tools/carrier.c\n");
    return 2;
}
