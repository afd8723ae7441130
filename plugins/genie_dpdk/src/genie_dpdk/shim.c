/* genie-dpdk's data path: a reliable byte stream per channel over one DPDK port.
 *
 * Compiled at install by cffi (API mode; see genie_dpdk/_build.py) against Debian's
 * libdpdk-dev. Python calls gd_* functions; every call releases the GIL.
 *
 * Frames (Ethernet, ethertype 0x88B5) carry a 40-byte header (struct gd_hdr):
 *   DATA  segment `seq` of the sender's stream, `len` payload bytes;
 *   ACK   every segment < `seq` arrived (cumulative); its payload, SACK_WORDS 64-bit words, has
 *         bit i set when segment seq+1+i arrived too (the whole window); the sender may send segments < `limit` (the receiver's window);
 *   PROBE the sender's window is closed and nothing is in flight: answer with an ACK.
 * The receiver keeps NSLOT segment slots (selective repeat: out-of-order segments are
 * kept); the sender retransmits a segment after its timeout or when a later one was
 * acknowledged past it (fast retransmit from SACK). One polling thread per process
 * (gd_engine_start/stop) does every rx/tx burst; callers' threads hand it work and
 * wait on a condition variable.
 *
 * Closing (the reason for ctl_fd): a memif peer that closes its port makes DPDK unmap our port's
 * shared memory on EAL's interrupt thread, under a burst the engine may be running on that port
 * (SIGSEGV). So a port is polled only while its peer is known to poll too: each channel watches its
 * TCP control stream (a descriptor of its own, ctl_fd); when the peer shuts its sending side, the
 * engine stops polling the channel at once and shuts ours, and a closing side shuts its sending side
 * only after its engine let go of the channel and closes its port only after the peer's shutdown came
 * (genie_dpdk.channel). Both ports are closed only when neither engine touches them.
 *
 * A peer that is killed (SIGKILL, a crash) gives no such order: its control stream and its memif
 * socket close together, and EAL's interrupt thread may unmap the shared memory while the engine is
 * inside a burst on that port. So every burst runs under a fault guard (guarded_rx / guarded_tx): a
 * SIGSEGV or SIGBUS inside one jumps back to the engine loop, which takes the channel's peer as gone
 * (its waiters get an error, its port is never polled again) instead of the process dying. A fault
 * anywhere else goes to the handler that was there before (Python's faulthandler, or the default).
 *
 * Loss injection for tests: gd_chan_set_loss drops received frames with a seeded
 * probability, on the receive side, before any protocol processing.
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <rte_alarm.h>
#include <rte_bus_vdev.h>
#include <rte_cycles.h>
#include <rte_eal.h>
#include <rte_errno.h>
#include <rte_ethdev.h>
#include <rte_lcore.h>
#include <rte_mbuf.h>
#include <rte_mempool.h>
#include <rte_version.h>

#define GD_ETHERTYPE 0x88B5
#define NSLOT 1024
#define BURST 32
#define MAXCHAN 64
#define T_DATA 1
#define T_ACK 2
#define T_PROBE 3
#define SACK_WORDS (NSLOT / 64)

struct gd_hdr {
    uint32_t chan;
    uint8_t type;
    uint8_t dir; /* 0: sent by the client side, 1: by the server side */
    uint16_t len;
    uint32_t pad;
    uint64_t seq;
    uint64_t spare;
    uint64_t limit;
} __attribute__((packed));

#define HDR_BYTES (sizeof(struct rte_ether_hdr) + sizeof(struct gd_hdr))

struct gd_chan {
    uint16_t port;
    uint32_t id;
    uint8_t dir;
    struct rte_ether_addr my_mac, peer_mac;
    uint32_t mss;
    struct rte_mempool *pool;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int closed;
    int error;
    int ctl_fd;    /* the TCP control stream (a dup owned by Python), -1: none */
    int peer_gone; /* the peer shut its control stream: never touch the port again */
    /* sender: one operation at a time */
    const uint8_t *tx_buf;
    uint64_t tx_len, tx_first, tx_end; /* segments [tx_first, tx_end) */
    int tx_active;
    uint64_t snd_una, snd_nxt, snd_limit;
    uint64_t sent_tsc[NSLOT];
    uint8_t acked[NSLOT];
    uint8_t retx[NSLOT];
    uint64_t srtt_tsc, rto_tsc, last_probe;
    /* receiver */
    uint8_t *slots;
    uint16_t slot_len[NSLOT];
    uint8_t have[NSLOT];
    uint64_t rcv_nxt, rcv_read;
    uint32_t read_off;
    /* a receive waiting with nothing buffered: in-order segments go straight into it (one copy less) */
    uint8_t *rx_user;
    uint64_t rx_user_len, rx_user_got;
    int rx_wake; /* bytes went into rx_user since its waiter last woke */
    int ack_due;
    int final_acks; /* acks still to send after close (gd_chan_close) */
    /* loss injection */
    uint32_t loss_ppm;
    uint64_t rng;
    /* counters */
    uint64_t tx_frames, retransmits, rx_frames, injected_drops, duplicates;
};

typedef struct gd_chan gd_chan;
static struct gd_chan *chans[MAXCHAN];

/* The fault guard (see the top): chan_jmp is the engine loop's jump point for the channel it serves;
 * burst_jmp holds it only while the engine thread is inside a burst on that channel's port. */
static __thread sigjmp_buf *chan_jmp;
static __thread sigjmp_buf *burst_jmp;
static __thread pthread_mutex_t *held_mu; /* a channel mutex the engine holds, released after a fault */
static struct sigaction prev_segv, prev_bus;
static int guard_installed;
static volatile int faults_recovered; /* bursts that faulted and were taken as their peer's death */

static void on_fault(int sig, siginfo_t *info, void *uc) {
    sigjmp_buf *jb = burst_jmp;
    if (jb != NULL) {
        burst_jmp = NULL;
        siglongjmp(*jb, 1);
    }
    struct sigaction *prev = sig == SIGSEGV ? &prev_segv : &prev_bus;
    if (prev->sa_flags & SA_SIGINFO) {
        prev->sa_sigaction(sig, info, uc);
    } else if (prev->sa_handler != SIG_DFL && prev->sa_handler != SIG_IGN) {
        prev->sa_handler(sig);
    } else { /* the default action: put it back; the faulting instruction runs again and ends the process */
        struct sigaction dfl;
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        sigaction(sig, &dfl, NULL);
    }
}

static void install_guard(void) { /* under reg_mu */
    if (guard_installed)
        return;
    struct sigaction act;
    memset(&act, 0, sizeof act);
    act.sa_sigaction = on_fault;
    act.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&act.sa_mask);
    sigaction(SIGSEGV, &act, &prev_segv);
    sigaction(SIGBUS, &act, &prev_bus);
    guard_installed = 1;
}

/* Bursts on the served channel's port, under the fault guard engine_main armed for it. */
static uint16_t guarded_rx(uint16_t port, struct rte_mbuf **ms, uint16_t n) {
    burst_jmp = chan_jmp;
    uint16_t got = rte_eth_rx_burst(port, 0, ms, n);
    burst_jmp = NULL;
    return got;
}

static uint16_t guarded_tx(uint16_t port, struct rte_mbuf **ms, uint16_t n) {
    burst_jmp = chan_jmp;
    uint16_t sent = rte_eth_tx_burst(port, 0, ms, n);
    burst_jmp = NULL;
    return sent;
}

static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;
static volatile int engine_run;
static pthread_t engine_thread;
static int engine_started;
static uint64_t hz;
/* Each port's mbuf pool (not every PMD answers rte_eth_rx_queue_info_get). */
static struct rte_mempool *port_pool[RTE_MAX_ETHPORTS];

/* ---- EAL ------------------------------------------------------------------------------ */
struct init_args { int argc; char **argv; int rc; int err; };

static void *init_main(void *p) {
    struct init_args *a = p;
    a->rc = rte_eal_init(a->argc, a->argv);
    a->err = rte_errno;
    return NULL;
}

/* rte_eal_init pins the calling thread to its lcore: run it on a helper thread so the
 * caller (Python's thread) keeps every CPU. Returns 0 or -rte_errno. */
int gd_eal_init(int argc, char **argv) {
    struct init_args a = {argc, argv, 0, 0};
    pthread_t t;
    if (pthread_create(&t, NULL, init_main, &a) != 0)
        return -EAGAIN;
    pthread_join(t, NULL);
    if (a.rc < 0)
        return -(a.err ? a.err : EINVAL);
    hz = rte_get_tsc_hz();
    return 0;
}

const char *gd_strerror(int err) { return rte_strerror(err < 0 ? -err : err); }
const char *gd_version(void) { return rte_version(); }

/* ---- ports ---------------------------------------------------------------------------- */
/* Create vdev `name` with `args`, configure one rx and one tx queue, start it.
 * Returns the port id or -errno. */
int gd_port_open(const char *name, const char *args, uint32_t mtu, uint32_t nmbufs) {
    uint16_t port;
    int rc = rte_vdev_init(name, args);
    if (rc < 0)
        return rc;
    if (rte_eth_dev_get_port_by_name(name, &port) != 0)
        return -ENODEV;
    char pool_name[RTE_MEMPOOL_NAMESIZE];
    snprintf(pool_name, sizeof pool_name, "gd%u_%s", port, name + (strlen(name) > 20 ? strlen(name) - 20 : 0));
    uint32_t room = mtu + 1280 + RTE_PKTMBUF_HEADROOM; /* the frame and a whole af_packet ring slot */
    struct rte_mempool *pool = rte_pktmbuf_pool_create(pool_name, nmbufs, 256, 0, room, SOCKET_ID_ANY);
    if (pool == NULL) {
        rc = -rte_errno;
        rte_vdev_uninit(name);
        return rc;
    }
    struct rte_eth_conf conf;
    memset(&conf, 0, sizeof conf);
    struct rte_eth_dev_info info;
    /* memif reports a 1500-byte MTU yet carries frames up to its buffer size (bsize): the port is
     * configured within what it reports, our frames follow the MTU the caller chose. */
    conf.rxmode.mtu = mtu;
    if (rte_eth_dev_info_get(port, &info) == 0) {
        if (info.max_mtu < conf.rxmode.mtu)
            conf.rxmode.mtu = info.max_mtu;
        if (info.max_rx_pktlen < conf.rxmode.mtu + RTE_ETHER_HDR_LEN + RTE_ETHER_CRC_LEN)
            conf.rxmode.mtu = info.max_rx_pktlen - RTE_ETHER_HDR_LEN - RTE_ETHER_CRC_LEN;
    }
    rc = rte_eth_dev_configure(port, 1, 1, &conf);
    if (rc == 0)
        rc = rte_eth_rx_queue_setup(port, 0, 1024, SOCKET_ID_ANY, NULL, pool);
    if (rc == 0)
        rc = rte_eth_tx_queue_setup(port, 0, 1024, SOCKET_ID_ANY, NULL);
    if (rc == 0)
        rc = rte_eth_dev_start(port);
    if (rc < 0) {
        rte_eth_dev_close(port);
        rte_vdev_uninit(name);
        rte_mempool_free(pool);
        return rc;
    }
    port_pool[port] = pool;
    return port;
}

int gd_port_mac(uint16_t port, uint8_t *out) {
    struct rte_ether_addr mac;
    int rc = rte_eth_macaddr_get(port, &mac);
    if (rc == 0)
        memcpy(out, mac.addr_bytes, 6);
    return rc;
}

int gd_port_link_up(uint16_t port) {
    struct rte_eth_link link;
    if (rte_eth_link_get_nowait(port, &link) != 0)
        return 0;
    return link.link_status == RTE_ETH_LINK_UP;
}

static void port_close_now(uint16_t port, const char *name) {
    struct rte_mempool *pool = port < RTE_MAX_ETHPORTS ? port_pool[port] : NULL;
    if (pool != NULL)
        port_pool[port] = NULL;
    rte_eth_dev_stop(port);
    rte_eth_dev_close(port);
    rte_vdev_uninit(name);
    if (pool != NULL)
        rte_mempool_free(pool);
}

struct close_req {
    uint16_t port;
    const char *name;
    int done;
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

static void close_on_intr_thread(void *arg) {
    struct close_req *r = arg;
    port_close_now(r->port, r->name);
    pthread_mutex_lock(&r->mu);
    r->done = 1;
    pthread_cond_signal(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

/* Stop, close and remove a port. It runs on EAL's interrupt thread (an alarm): memif handles its
 * peer's messages there, and removing a port from another thread while a message for it is being
 * handled crashes DPDK 22.11's memif. */
void gd_port_close(uint16_t port, const char *name) {
    struct close_req r = {port, name, 0, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};
    if (rte_eal_alarm_set(1, close_on_intr_thread, &r) != 0) {
        port_close_now(port, name);
        return;
    }
    pthread_mutex_lock(&r.mu);
    while (!r.done)
        pthread_cond_wait(&r.cv, &r.mu);
    pthread_mutex_unlock(&r.mu);
}

/* ---- channels ------------------------------------------------------------------------- */
struct gd_chan *gd_chan_new(uint16_t port, uint32_t id, uint8_t dir, const uint8_t *peer_mac, uint32_t mss,
                            int ctl_fd) {
    struct gd_chan *c = calloc(1, sizeof *c);
    if (c == NULL)
        return NULL;
    c->slots = malloc((size_t)NSLOT * mss);
    if (c->slots == NULL) {
        free(c);
        return NULL;
    }
    c->port = port;
    c->id = id;
    c->dir = dir;
    c->mss = mss;
    c->ctl_fd = ctl_fd;
    rte_eth_macaddr_get(port, &c->my_mac);
    memcpy(c->peer_mac.addr_bytes, peer_mac, 6);
    c->pool = port < RTE_MAX_ETHPORTS ? port_pool[port] : NULL;
    if (c->pool == NULL) {
        free(c->slots);
        free(c);
        return NULL;
    }
    pthread_mutex_init(&c->mu, NULL);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&c->cv, &attr);
    c->snd_limit = NSLOT; /* the peer has NSLOT slots too */
    c->srtt_tsc = hz / 2000;  /* 500 us until measured */
    c->rto_tsc = hz / 100;    /* 10 ms */
    pthread_mutex_lock(&reg_mu);
    int i;
    for (i = 0; i < MAXCHAN && chans[i] != NULL; i++)
        ;
    if (i == MAXCHAN) {
        pthread_mutex_unlock(&reg_mu);
        free(c->slots);
        free(c);
        return NULL;
    }
    chans[i] = c;
    pthread_mutex_unlock(&reg_mu);
    return c;
}

void gd_chan_set_loss(struct gd_chan *c, uint32_t ppm, uint64_t seed) {
    pthread_mutex_lock(&c->mu);
    c->loss_ppm = ppm;
    c->rng = seed ? seed : 0x9E3779B97F4A7C15ULL;
    pthread_mutex_unlock(&c->mu);
}

/* Wake every waiter with an error; the channel stays registered until gd_chan_free. */
static void deadline_of(struct timespec *ts, double timeout);

/* Wake every waiter with an error; the channel stays registered until gd_chan_free. Before that,
 * the engine sends a last ack (twice, bounded to ~20 ms), so a peer whose final segments we took
 * just before closing learns it instead of waiting for its timeout. */
void gd_chan_close(struct gd_chan *c) {
    pthread_mutex_lock(&c->mu);
    c->closed = 1;
    c->final_acks = engine_started && !c->peer_gone ? 2 : 0;
    pthread_cond_broadcast(&c->cv);
    struct timespec ts;
    deadline_of(&ts, 0.02);
    while (c->final_acks > 0)
        if (pthread_cond_timedwait(&c->cv, &c->mu, &ts) == ETIMEDOUT)
            break;
    c->final_acks = 0;
    pthread_mutex_unlock(&c->mu);
}

void gd_chan_free(struct gd_chan *c) {
    pthread_mutex_lock(&reg_mu);
    for (int i = 0; i < MAXCHAN; i++)
        if (chans[i] == c)
            chans[i] = NULL;
    pthread_mutex_unlock(&reg_mu);
    /* The engine holds reg_mu for a whole pass: after this point it no longer sees c. */
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c->slots);
    free(c);
}

int gd_chan_peer_gone(struct gd_chan *c) {
    pthread_mutex_lock(&c->mu);
    int gone = c->peer_gone;
    pthread_mutex_unlock(&c->mu);
    return gone;
}

int gd_chan_stats(struct gd_chan *c, uint64_t *out) {
    pthread_mutex_lock(&c->mu);
    out[0] = c->tx_frames;
    out[1] = c->retransmits;
    out[2] = c->rx_frames;
    out[3] = c->injected_drops;
    out[4] = c->duplicates;
    out[5] = c->srtt_tsc * 1000000 / (hz ? hz : 1);
    pthread_mutex_unlock(&c->mu);
    return 6;
}

static void deadline_of(struct timespec *ts, double timeout) {
    clock_gettime(CLOCK_MONOTONIC, ts);
    long sec = (long)timeout;
    long nsec = (long)((timeout - (double)sec) * 1e9);
    ts->tv_sec += sec;
    ts->tv_nsec += nsec;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

/* Post a send of `len` bytes of `buf` (one at a time per channel); the engine moves it, gd_send_wait
 * waits for the peer's acknowledgement. `buf` must stay valid until then. 0 or -EPIPE (closed). */
int gd_send_post(struct gd_chan *c, const uint8_t *buf, uint64_t len) {
    pthread_mutex_lock(&c->mu);
    if (c->closed || c->error || c->tx_active) {
        pthread_mutex_unlock(&c->mu);
        return -EPIPE;
    }
    c->tx_buf = buf;
    c->tx_len = len;
    c->tx_first = c->snd_nxt;
    c->tx_end = c->tx_first + (len + c->mss - 1) / c->mss;
    c->tx_active = len > 0;
    pthread_mutex_unlock(&c->mu);
    return 0;
}

/* Wait up to `slice` s for the posted send: 0 when every byte is acknowledged, -EAGAIN when not yet,
 * -EPIPE when the channel closed or failed. */
int gd_send_wait(struct gd_chan *c, double slice) {
    struct timespec ts;
    deadline_of(&ts, slice);
    pthread_mutex_lock(&c->mu);
    int rc = 0;
    while (c->tx_active && c->snd_una < c->tx_end) {
        if (c->closed || c->error || c->peer_gone) {
            rc = -EPIPE;
            break;
        }
        if (pthread_cond_timedwait(&c->cv, &c->mu, &ts) == ETIMEDOUT) {
            rc = c->snd_una < c->tx_end ? -EAGAIN : 0;
            break;
        }
    }
    if (rc != -EAGAIN) {
        c->tx_active = 0;
        c->tx_buf = NULL;
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

/* Give up on the posted send: the stream position is lost, so the channel fails for good. */
void gd_fail(struct gd_chan *c) {
    pthread_mutex_lock(&c->mu);
    c->error = 1;
    c->tx_active = 0;
    c->tx_buf = NULL;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

/* Receive up to `len` bytes into `buf`, waiting at most `slice` s for the first ones: how many
 * arrived (0 when none in time), or -EPIPE when the channel closed or failed. */
int64_t gd_recv(struct gd_chan *c, uint8_t *buf, uint64_t len, double slice) {
    struct timespec ts;
    deadline_of(&ts, slice);
    uint64_t got = 0;
    pthread_mutex_lock(&c->mu);
    while (got < len) {
        if (c->closed || c->error) {
            pthread_mutex_unlock(&c->mu);
            return got ? (int64_t)got : -EPIPE;
        }
        if (c->rcv_read == c->rcv_nxt) {
            if (c->peer_gone) { /* everything it sent was acknowledged, so it is here: nothing more comes */
                pthread_mutex_unlock(&c->mu);
                return got ? (int64_t)got : -EPIPE;
            }
            if (got)
                break;
            /* Nothing buffered: the engine puts in-order segments straight into buf while we wait. */
            c->rx_user = buf;
            c->rx_user_len = len;
            c->rx_user_got = 0;
            int rc = pthread_cond_timedwait(&c->cv, &c->mu, &ts);
            got = c->rx_user_got;
            c->rx_user = NULL;
            c->rx_wake = 0;
            if (got == 0 && rc == ETIMEDOUT)
                break;
            continue;
        }
        /* Slots in [rcv_read, rcv_nxt) are complete and the engine leaves them alone: copy unlocked. */
        uint64_t upto = c->rcv_nxt;
        pthread_mutex_unlock(&c->mu);
        uint64_t seq = c->rcv_read;
        uint32_t off = c->read_off;
        while (seq < upto && got < len) {
            uint32_t slot = seq % NSLOT;
            uint32_t n = c->slot_len[slot] - off;
            if (n > len - got)
                n = (uint32_t)(len - got);
            memcpy(buf + got, c->slots + (size_t)slot * c->mss + off, n);
            got += n;
            off += n;
            if (off == c->slot_len[slot]) {
                c->have[slot] = 0;
                seq++;
                off = 0;
            }
        }
        pthread_mutex_lock(&c->mu);
        if (seq != c->rcv_read)
            c->ack_due = 1; /* the window opened: tell the sender */
        c->rcv_read = seq;
        c->read_off = off;
    }
    pthread_mutex_unlock(&c->mu);
    return (int64_t)got;
}

/* ---- the engine ----------------------------------------------------------------------- */
static struct rte_mbuf *frame(struct gd_chan *c, uint8_t type, uint64_t seq, const uint8_t *payload, uint16_t len) {
    struct rte_mbuf *m = rte_pktmbuf_alloc(c->pool);
    if (m == NULL)
        return NULL;
    char *p = rte_pktmbuf_append(m, (uint16_t)(HDR_BYTES + len));
    if (p == NULL) {
        rte_pktmbuf_free(m);
        return NULL;
    }
    struct rte_ether_hdr *eth = (struct rte_ether_hdr *)p;
    rte_ether_addr_copy(&c->peer_mac, &eth->dst_addr);
    rte_ether_addr_copy(&c->my_mac, &eth->src_addr);
    eth->ether_type = rte_cpu_to_be_16(GD_ETHERTYPE);
    struct gd_hdr *h = (struct gd_hdr *)(eth + 1);
    memset(h, 0, sizeof *h);
    h->chan = c->id;
    h->type = type;
    h->dir = c->dir;
    h->len = len;
    h->seq = seq;
    if (type == T_ACK) {
        uint64_t sack[SACK_WORDS];
        memset(sack, 0, sizeof sack);
        for (uint64_t s = c->rcv_nxt + 1; s < c->rcv_read + NSLOT && s - c->rcv_nxt - 1 < NSLOT; s++)
            if (c->have[s % NSLOT])
                sack[(s - c->rcv_nxt - 1) / 64] |= 1ULL << ((s - c->rcv_nxt - 1) % 64);
        h->limit = c->rcv_read + NSLOT;
        memcpy((uint8_t *)(h + 1), sack, sizeof sack);
    } else if (len) {
        memcpy((uint8_t *)(h + 1), payload, len);
    }
    return m;
}

static void send_frames(struct gd_chan *c, struct rte_mbuf **ms, uint64_t *seqs, int n, int *is_new) {
    uint16_t sent = n ? guarded_tx(c->port, ms, (uint16_t)n) : 0;
    uint64_t now = rte_get_tsc_cycles();
    for (int i = 0; i < n; i++) {
        if (i < sent) {
            c->tx_frames++;
            if (seqs[i] != UINT64_MAX && !is_new[i])
                c->retransmits++;
            if (seqs[i] != UINT64_MAX)
                c->sent_tsc[seqs[i] % NSLOT] = now;
            continue;
        }
        rte_pktmbuf_free(ms[i]);
        if (seqs[i] == UINT64_MAX) {
            c->ack_due = 1; /* an ack (or probe) the ring refused: the next pass sends a fresh one */
            continue;
        }
        if (is_new[i] && seqs[i] < c->snd_nxt)
            c->snd_nxt = seqs[i]; /* the ring was full: send it again next pass */
        else
            c->sent_tsc[seqs[i] % NSLOT] = 0;
    }
}

/* Retransmissions due, then new segments within the window; called with c->mu held. */
static void pump_tx(struct gd_chan *c, uint64_t now) {
    struct rte_mbuf *ms[BURST];
    uint64_t seqs[BURST];
    int is_new[BURST];
    int n = 0;
    if (c->ack_due) {
        struct rte_mbuf *m = frame(c, T_ACK, c->rcv_nxt, NULL, SACK_WORDS * 8);
        if (m != NULL) {
            ms[n] = m;
            seqs[n] = UINT64_MAX;
            is_new[n++] = 0;
            c->ack_due = 0;
        }
    }
    if (c->tx_active && c->tx_buf != NULL) {
        for (uint64_t s = c->snd_una; s < c->snd_nxt && n < BURST; s++) {
            uint32_t slot = s % NSLOT;
            /* Resend what SACK marked lost (sent_tsc 0) or what the ring refused; on a timeout only the
             * oldest segment, with the timeout doubled until an ack comes (a stalled peer must not
             * cost a whole window of spurious copies). */
            if (c->acked[slot] || (c->sent_tsc[slot] && (s != c->snd_una || now - c->sent_tsc[slot] < c->rto_tsc)))
                continue;
            if (c->sent_tsc[slot] && c->rto_tsc < hz / 5)
                c->rto_tsc *= 2;
            uint64_t off = (s - c->tx_first) * c->mss;
            uint16_t len = (uint16_t)(c->tx_len - off < c->mss ? c->tx_len - off : c->mss);
            struct rte_mbuf *m = frame(c, T_DATA, s, c->tx_buf + off, len);
            if (m == NULL)
                break;
            c->retx[slot] = 1;
            ms[n] = m;
            seqs[n] = s;
            is_new[n++] = 0;
        }
        uint64_t stop = c->tx_end;
        if (stop > c->snd_limit)
            stop = c->snd_limit;
        if (stop > c->snd_una + NSLOT)
            stop = c->snd_una + NSLOT;
        while (c->snd_nxt < stop && n < BURST) {
            uint64_t s = c->snd_nxt;
            uint32_t slot = s % NSLOT;
            uint64_t off = (s - c->tx_first) * c->mss;
            uint16_t len = (uint16_t)(c->tx_len - off < c->mss ? c->tx_len - off : c->mss);
            struct rte_mbuf *m = frame(c, T_DATA, s, c->tx_buf + off, len);
            if (m == NULL)
                break;
            c->acked[slot] = 0;
            c->retx[slot] = 0;
            ms[n] = m;
            seqs[n] = s;
            is_new[n++] = 1;
            c->snd_nxt++;
        }
        /* Window closed with nothing in flight: ask for a window update now and then. */
        if (c->snd_una == c->snd_nxt && c->snd_nxt < c->tx_end && c->snd_nxt >= c->snd_limit && n < BURST &&
            now - c->last_probe > c->rto_tsc) {
            struct rte_mbuf *m = frame(c, T_PROBE, c->snd_nxt, NULL, 0);
            if (m != NULL) {
                ms[n] = m;
                seqs[n] = UINT64_MAX;
                is_new[n++] = 0;
                c->last_probe = now;
            }
        }
    }
    send_frames(c, ms, seqs, n, is_new);
}

static int drop_injected(struct gd_chan *c) {
    if (!c->loss_ppm)
        return 0;
    c->rng ^= c->rng << 13;
    c->rng ^= c->rng >> 7;
    c->rng ^= c->rng << 17;
    return (c->rng % 1000000) < c->loss_ppm;
}

static void on_ack(struct gd_chan *c, const struct gd_hdr *h, const uint64_t *sack, uint64_t now) {
    if (h->limit > c->snd_limit)
        c->snd_limit = h->limit;
    uint64_t cum = h->seq;
    if (cum > c->snd_nxt)
        return; /* acknowledges what we never sent: ignore */
    while (c->snd_una < cum) {
        uint32_t slot = c->snd_una % NSLOT;
        if (!c->acked[slot] && !c->retx[slot] && c->sent_tsc[slot]) {
            uint64_t sample = now - c->sent_tsc[slot]; /* Karn: never from a retransmitted segment */
            c->srtt_tsc = (7 * c->srtt_tsc + sample) / 8;
        }
        c->acked[slot] = 1;
        c->snd_una++;
    }
    /* Twice the smoothed round trip plus 1 ms, within [2 ms, 200 ms]: a window of jumbo frames queues
     * for milliseconds, and a shared machine stalls a process for as long; a spurious retransmission
     * costs a frame, a late one only the tail of a transfer (SACK recovers holes sooner). */
    uint64_t rto = 2 * c->srtt_tsc + hz / 1000;
    if (rto < hz / 500)
        rto = hz / 500;
    if (rto > hz / 5)
        rto = hz / 5;
    c->rto_tsc = rto;
    int highest = -1;
    for (int i = 0; i < NSLOT - 1; i++) {
        uint64_t s = cum + 1 + i;
        if (s >= c->snd_nxt)
            break;
        if (s >= c->snd_una && (sack[i / 64] >> (i % 64) & 1)) {
            c->acked[s % NSLOT] = 1;
            highest = i;
        }
    }
    /* Fast retransmit: a hole below the highest selectively acknowledged segment, unless resent just now. */
    for (int i = -1; i < highest; i++) {
        uint64_t s = cum + 1 + i;
        uint32_t slot = s % NSLOT;
        if (s < c->snd_una)
            continue;
        if (!c->acked[slot] && c->sent_tsc[slot] && now - c->sent_tsc[slot] > c->srtt_tsc)
            c->sent_tsc[slot] = 0;
    }
    if (c->tx_active && c->snd_una >= c->tx_end)
        pthread_cond_broadcast(&c->cv);
}

static void on_data(struct gd_chan *c, const struct gd_hdr *h, const uint8_t *payload) {
    uint64_t s = h->seq;
    c->ack_due = 1;
    if (s < c->rcv_nxt || s >= c->rcv_read + NSLOT || h->len > c->mss || h->len == 0) {
        c->duplicates++;
        return;
    }
    uint32_t slot = s % NSLOT;
    if (c->have[slot]) {
        c->duplicates++;
        return;
    }
    if (s == c->rcv_nxt && c->rcv_read == c->rcv_nxt && c->rx_user != NULL &&
        h->len <= c->rx_user_len - c->rx_user_got) {
        /* The next segment, nothing buffered before it, a receive waiting: straight into its buffer. */
        memcpy(c->rx_user + c->rx_user_got, payload, h->len);
        c->rx_user_got += h->len;
        c->rcv_nxt++;
        c->rcv_read++;
        while (c->rcv_nxt < c->rcv_read + NSLOT && c->have[c->rcv_nxt % NSLOT])
            c->rcv_nxt++; /* segments that came early continue the stream from the slots */
        if (c->rx_user_got == c->rx_user_len || c->rcv_nxt != c->rcv_read)
            pthread_cond_broadcast(&c->cv);
        else
            c->rx_wake = 1; /* woken once the burst is done (see the engine) */
        return;
    }
    memcpy(c->slots + (size_t)slot * c->mss, payload, h->len);
    c->slot_len[slot] = h->len;
    c->have[slot] = 1;
    uint64_t before = c->rcv_nxt;
    while (c->rcv_nxt < c->rcv_read + NSLOT && c->have[c->rcv_nxt % NSLOT])
        c->rcv_nxt++;
    if (c->rcv_nxt != before)
        pthread_cond_broadcast(&c->cv);
}

static void on_frame(struct gd_chan *c, struct rte_mbuf *m, uint64_t now) {
    uint8_t copy[HDR_BYTES];
    const uint8_t *p = rte_pktmbuf_read(m, 0, HDR_BYTES, copy);
    if (p == NULL)
        return;
    const struct rte_ether_hdr *eth = (const struct rte_ether_hdr *)p;
    const struct gd_hdr *hp = (const struct gd_hdr *)(eth + 1);
    if (eth->ether_type != rte_cpu_to_be_16(GD_ETHERTYPE) || hp->chan != c->id || hp->dir == c->dir)
        return; /* not ours: another channel on this interface, our own frames seen outgoing, other traffic */
    struct gd_hdr h;
    memcpy(&h, hp, sizeof h);
    if (drop_injected(c)) {
        c->injected_drops++;
        return;
    }
    c->rx_frames++;
    if (h.type == T_ACK) {
        uint64_t sack[SACK_WORDS];
        const void *bits = h.len == sizeof sack ? rte_pktmbuf_read(m, HDR_BYTES, sizeof sack, sack) : NULL;
        if (bits == NULL)
            return; /* a short or malformed ack: ignore it, a later one says the same */
        if (bits != sack)
            memcpy(sack, bits, sizeof sack); /* aligned copy of the bitmap */
        on_ack(c, &h, sack, now);
    } else if (h.type == T_PROBE) {
        c->ack_due = 1;
    } else if (h.type == T_DATA) {
        if (rte_pktmbuf_pkt_len(m) < HDR_BYTES + h.len)
            return;
        if (m->nb_segs == 1) {
            on_data(c, &h, rte_pktmbuf_mtod_offset(m, const uint8_t *, HDR_BYTES));
        } else {
            static __thread uint8_t big[16384];
            if (h.len > sizeof big)
                return;
            const uint8_t *q = rte_pktmbuf_read(m, HDR_BYTES, h.len, big);
            if (q != NULL)
                on_data(c, &h, q);
        }
    }
}

/* Whether the peer shut its side of the control stream (or it failed). */
static int peer_shut(struct gd_chan *c) {
    if (c->ctl_fd < 0)
        return 0;
    struct pollfd p = {c->ctl_fd, POLLRDHUP, 0};
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL));
}

static void on_frame(struct gd_chan *c, struct rte_mbuf *m, uint64_t now);

/* The peer let go of its port (it shuts its control stream only after): take what its last frames
 * said (its final acks), then let go of ours for good and shut our side of the control stream, so
 * the peer, waiting for that, knows we no longer poll (see the top). Called with reg_mu held. */
static void let_go(struct gd_chan *c) {
    struct rte_mbuf *ms[BURST];
    uint16_t n;
    pthread_mutex_lock(&c->mu);
    held_mu = &c->mu;
    do {
        n = guarded_rx(c->port, ms, BURST);
        uint64_t now = rte_get_tsc_cycles();
        for (uint16_t k = 0; k < n; k++) {
            if (!c->closed)
                on_frame(c, ms[k], now);
            rte_pktmbuf_free(ms[k]);
        }
    } while (n == BURST);
    held_mu = NULL;
    c->peer_gone = 1;
    c->final_acks = 0;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    shutdown(c->ctl_fd, SHUT_WR);
}

/* A burst on the channel's port faulted: its peer died and DPDK unmapped the memory under the burst
 * (see the top). Whatever the burst left half done stays so: the port is never polled again. */
static void lost(struct gd_chan *c) {
    if (held_mu != NULL) {
        pthread_mutex_unlock(held_mu);
        held_mu = NULL;
    }
    pthread_mutex_lock(&c->mu);
    c->peer_gone = 1;
    c->final_acks = 0;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    if (c->ctl_fd >= 0)
        shutdown(c->ctl_fd, SHUT_WR);
}

static void *engine_main(void *unused) {
    (void)unused;
    rte_thread_register(); /* an lcore id: per-lcore mempool caches */
    struct rte_mbuf *ms[BURST];
    unsigned idle = 0, pass = 0;
    while (engine_run) {
        volatile int work = 0; /* volatile: kept across a fault's siglongjmp */
        /* The control streams are looked at every 16th pass while busy (a system call each) and at every
         * pass that naps; the closing side waits for our shutdown, so how soon only bounds its wait. */
        int look = (++pass & 15) == 0 || idle > 2000;
        pthread_mutex_lock(&reg_mu);
        for (int i = 0; i < MAXCHAN; i++) {
            struct gd_chan *c = chans[i];
            if (c == NULL || c->peer_gone)
                continue;
            sigjmp_buf jb;
            if (sigsetjmp(jb, 1) != 0) { /* a burst on c's port faulted */
                chan_jmp = NULL;
                faults_recovered++;
                lost(c);
                continue;
            }
            chan_jmp = &jb;
            if (look && peer_shut(c)) {
                let_go(c);
                chan_jmp = NULL;
                continue;
            }
            uint16_t n = guarded_rx(c->port, ms, BURST);
            uint64_t now = rte_get_tsc_cycles();
            pthread_mutex_lock(&c->mu);
            held_mu = &c->mu;
            for (uint16_t k = 0; k < n; k++) {
                if (!c->closed)
                    on_frame(c, ms[k], now);
                rte_pktmbuf_free(ms[k]);
            }
            if (c->rx_wake && n < BURST) { /* the port is drained: the waiter takes what came */
                c->rx_wake = 0;
                pthread_cond_broadcast(&c->cv);
            }
            if (!c->closed) {
                uint64_t before = c->tx_frames;
                pump_tx(c, now);
                if (c->tx_frames != before)
                    work = 1;
            } else if (c->final_acks > 0) {
                struct rte_mbuf *m = frame(c, T_ACK, c->rcv_nxt, NULL, SACK_WORDS * 8);
                if (m != NULL && guarded_tx(c->port, &m, 1) == 1)
                    c->final_acks--;
                else if (m != NULL)
                    rte_pktmbuf_free(m);
                if (c->final_acks == 0)
                    pthread_cond_broadcast(&c->cv);
                work = 1;
            }
            held_mu = NULL;
            pthread_mutex_unlock(&c->mu);
            chan_jmp = NULL;
            if (n)
                work = 1;
        }
        pthread_mutex_unlock(&reg_mu);
        /* Poll flat out while there is traffic; after ~2000 passes with nothing (~50 us), nap 20 us a pass, after
         * 100 more 250 us, so an idle session costs little CPU on a shared machine (its control frames
         * travel on TCP meanwhile). A core given to DPDK alone would never nap. */
        if (work) {
            idle = 0;
        } else if (++idle > 2100) {
            struct timespec nap = {0, 250000};
            nanosleep(&nap, NULL);
        } else if (idle > 2000) {
            struct timespec nap = {0, 20000};
            nanosleep(&nap, NULL);
        } else {
            rte_pause();
        }
    }
    rte_thread_unregister();
    return NULL;
}

int gd_engine_start(void) {
    pthread_mutex_lock(&reg_mu);
    int rc = 0;
    if (!engine_started) {
        install_guard();
        engine_run = 1;
        rc = pthread_create(&engine_thread, NULL, engine_main, NULL);
        if (rc == 0)
            engine_started = 1;
    }
    pthread_mutex_unlock(&reg_mu);
    return -rc;
}

void gd_engine_stop(void) {
    pthread_mutex_lock(&reg_mu);
    int was = engine_started;
    engine_run = 0;
    engine_started = 0;
    pthread_mutex_unlock(&reg_mu);
    if (was)
        pthread_join(engine_thread, NULL);
}

int gd_engine_running(void) { return engine_started; }

int gd_faults_recovered(void) { return faults_recovered; }
