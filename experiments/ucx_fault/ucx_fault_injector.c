/*
 * kvcached-pd's UCX fault injector: an LD_PRELOAD shim that makes every Nth UCX one-sided
 * operation fail, so that the load harness can prove a PD pair survives failed KV
 * transfers (vLLM's own nixl_integration test does this with an injector that is not
 * installable on the offline GPU host).
 *
 * What it interposes: the UCX calls with which NIXL's UCX backend plugin
 * (libplugin_UCX.so, its imports checked with nm -D) moves data: ucp_get_nbx (a READ, D
 * pulling from P), ucp_put_nbx (a WRITE, P pushing) and ucp_ep_flush_nbx. NIXL dlopen()s
 * the plugin RTLD_LOCAL; the plugin's undefined symbols are looked up in the global scope
 * first, where an LD_PRELOAD library sits, so these definitions win over the bundled
 * libucp's. Not with NIXL_UCX_DEEPBIND=1 (RTLD_DEEPBIND: the plugin binds its own libucp
 * first and nothing here is called); the load line warns then.
 *
 * A failed call returns UCS_STATUS_PTR(code) at once, without calling UCX: what UCX
 * itself returns when it cannot start an operation (no completion callback follows), so
 * NIXL sees a backend error for that transfer.
 *
 * Configuration, read once at load. The names are those of the ucx-fault-injector that
 * vLLM's test uses, so the harness drives either library with the same environment:
 *   KVPD_UCX_FAULT_EVERY=N   fail every Nth counted call (N >= 1); enough on its own
 *   UCX_FAULT_ENABLED=1 UCX_FAULT_STRATEGY=pattern UCX_FAULT_PATTERN=OOOX
 *                            (when KVPD_UCX_FAULT_EVERY is unset) counted call i fails
 *                            when pattern[(i-1) % len] is X; O lets it pass
 *   UCX_FAULT_HOOKS=flush    the calls counted and failed: get, put, flush (or their
 *                            ucp_*_nbx names), all (the default, as there). NIXL's UCX
 *                            backend posts one get (READ) or put (WRITE) per descriptor,
 *                            then one ucp_ep_flush_nbx per transfer (NIXL 1.5.1, measured
 *                            also with 4 UCX threads, as vLLM configures it), so "flush"
 *                            fails every Nth NIXL transfer whatever its size, and "get"
 *                            every Nth descriptor (nearly every transfer of a many-block
 *                            request)
 *   UCX_FAULT_ERROR_CODES=-3 the ucs_status_t returned, cycled over the faults when
 *                            several; default -3 (UCS_ERR_IO_ERROR)
 *   UCX_FAULT_DEBUG=1        also log every counted call that passes (to see which UCX
 *                            calls one NIXL transfer makes)
 * Calls are counted per process, across threads, over the enabled hooks only.
 *
 * Logs to stderr: one line at load ("UCX fault injector loaded: ..." when armed, "UCX
 * fault injector inactive ..." when not) and one line per injected fault, numbered:
 *   ucx_fault_injector[PID]: [FAULT] INJECTED #K: ucp_get_nbx call #I -> status -3
 *
 * Built by build.sh next to this file. No UCX headers needed: the few types are declared
 * here (pointers, and ucs_status_t, a C enum of int size).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

typedef int ucs_status_t;
typedef void *ucs_status_ptr_t;
typedef struct ucp_ep *ucp_ep_h;
typedef struct ucp_rkey *ucp_rkey_h;
typedef struct ucp_request_param ucp_request_param_t; /* only passed through */
#define UCS_STATUS_PTR(_status) ((void *)(intptr_t)(_status))
#define UCS_ERR_IO_ERROR (-3)

typedef ucs_status_ptr_t (*get_fn)(ucp_ep_h, void *, size_t, uint64_t, ucp_rkey_h,
                                   const ucp_request_param_t *);
typedef ucs_status_ptr_t (*put_fn)(ucp_ep_h, const void *, size_t, uint64_t, ucp_rkey_h,
                                   const ucp_request_param_t *);
typedef ucs_status_ptr_t (*flush_fn)(ucp_ep_h, const ucp_request_param_t *);

enum { HOOK_GET, HOOK_PUT, HOOK_FLUSH, N_HOOKS };
static const char *const hook_names[N_HOOKS] = {"ucp_get_nbx", "ucp_put_nbx",
                                                "ucp_ep_flush_nbx"};
static const char *const hook_short[N_HOOKS] = {"get", "put", "flush"};

#define MAX_PATTERN 4096
#define MAX_CODES 16
static char pattern[MAX_PATTERN + 1]; /* empty: inactive, every call passes through */
static size_t pattern_len;
static int hook_on[N_HOOKS] = {1, 1, 1};
static int debug;           /* UCX_FAULT_DEBUG: log every counted call, not only faults */
static ucs_status_t codes[MAX_CODES] = {UCS_ERR_IO_ERROR};
static size_t n_codes = 1;
static unsigned long calls;  /* counted calls in this process */
static unsigned long faults; /* faults injected in this process */
static void *real_fn[N_HOOKS];

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...) {
    /* One write(2) per line: lines of concurrent threads and processes stay whole. */
    char buf[512];
    size_t n = (size_t)snprintf(buf, sizeof buf, "ucx_fault_injector[%d]: ", (int)getpid());
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(buf + n, sizeof buf - n - 1, fmt, ap);
    va_end(ap);
    n = m < 0 ? n : (n + (size_t)m > sizeof buf - 2 ? sizeof buf - 2 : n + (size_t)m);
    buf[n++] = '\n';
    ssize_t ignored = write(2, buf, n);
    (void)ignored;
}

static int truthy(const char *v) {
    return v && (!strcmp(v, "1") || !strcasecmp(v, "true") || !strcasecmp(v, "yes") ||
                 !strcasecmp(v, "on"));
}

static void parse_hooks(const char *v) {
    char tmp[256];
    snprintf(tmp, sizeof tmp, "%s", v);
    memset(hook_on, 0, sizeof hook_on);
    for (char *save = NULL, *t = strtok_r(tmp, ", ", &save); t; t = strtok_r(NULL, ", ", &save)) {
        int known = 0;
        for (int h = 0; h < N_HOOKS; h++)
            if (!strcmp(t, "all") || !strcmp(t, hook_names[h]) || !strcmp(t, hook_short[h]))
                hook_on[h] = known = 1;
        if (!known) say("UCX_FAULT_HOOKS: unknown hook '%s' ignored", t);
    }
}

static void parse_codes(const char *v) {
    char tmp[256];
    snprintf(tmp, sizeof tmp, "%s", v);
    size_t n = 0;
    for (char *save = NULL, *t = strtok_r(tmp, ", ", &save); t && n < MAX_CODES;
         t = strtok_r(NULL, ", ", &save)) {
        long c = strtol(t, NULL, 10);
        if (c < 0) codes[n++] = (ucs_status_t)c;
        else say("UCX_FAULT_ERROR_CODES: '%s' is not a UCX error (< 0), ignored", t);
    }
    if (n) n_codes = n;
}

static void set_pattern(void) {
    const char *every = getenv("KVPD_UCX_FAULT_EVERY");
    if (every && *every) {
        long n = strtol(every, NULL, 10);
        if (n < 1 || n > MAX_PATTERN) {
            say("KVPD_UCX_FAULT_EVERY=%s: not in 1..%d", every, MAX_PATTERN);
            return;
        }
        memset(pattern, 'O', (size_t)n - 1);
        pattern[n - 1] = 'X';
        return;
    }
    if (!truthy(getenv("UCX_FAULT_ENABLED"))) return;
    const char *strategy = getenv("UCX_FAULT_STRATEGY");
    const char *pat = getenv("UCX_FAULT_PATTERN");
    if (strategy && strcmp(strategy, "pattern"))
        say("UCX_FAULT_STRATEGY=%s: only 'pattern' is supported here", strategy);
    else if (!pat || !*pat || strspn(pat, "XO") != strlen(pat) || !strchr(pat, 'X') ||
             strlen(pat) > MAX_PATTERN)
        say("UCX_FAULT_PATTERN=%s: X (fail) and O (pass) only, at least one X, at most %d",
            pat ? pat : "(unset)", MAX_PATTERN);
    else
        snprintf(pattern, sizeof pattern, "%s", pat);
}

__attribute__((constructor)) static void init(void) {
    set_pattern();
    pattern_len = strlen(pattern);
    const char *hooks = getenv("UCX_FAULT_HOOKS");
    if (hooks && *hooks) parse_hooks(hooks);
    const char *cv = getenv("UCX_FAULT_ERROR_CODES");
    if (cv && *cv) parse_codes(cv);
    debug = truthy(getenv("UCX_FAULT_DEBUG"));
    if (!pattern_len) {
        say("UCX fault injector inactive: set KVPD_UCX_FAULT_EVERY=N, or UCX_FAULT_ENABLED=1 "
            "UCX_FAULT_STRATEGY=pattern UCX_FAULT_PATTERN=...");
        return;
    }
    size_t n_x = 0;
    for (size_t i = 0; i < pattern_len; i++) n_x += pattern[i] == 'X';
    const char *db = getenv("NIXL_UCX_DEEPBIND");
    int deepbind = db && *db && !strchr("0fFnN", db[0]) && strcasecmp(db, "off");
    say("UCX fault injector loaded: %zu of every %zu calls fail (pattern %.40s%s); hooks:%s%s%s;"
        " error %d%s%s",
        n_x, pattern_len, pattern, pattern_len > 40 ? "..." : "",
        hook_on[HOOK_GET] ? " get" : "", hook_on[HOOK_PUT] ? " put" : "",
        hook_on[HOOK_FLUSH] ? " flush" : "", codes[0], n_codes > 1 ? " (and more, cycled)" : "",
        deepbind ? "; WARNING: NIXL_UCX_DEEPBIND is set, NIXL's UCX plugin then binds its own "
                   "libucp and no fault is injected" : "");
}

/* ---- the real UCX functions --------------------------------------------------------- */

struct lookup {
    const char *name;
    void *self;
    void *found;
};

static int find_in_libucp(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct lookup *l = data;
    if (!info->dlpi_name || !strstr(info->dlpi_name, "libucp")) return 0;
    void *h = dlopen(info->dlpi_name, RTLD_LAZY | RTLD_NOLOAD);
    if (!h) return 0;
    void *f = dlsym(h, l->name);
    dlclose(h); /* drops only the reference RTLD_NOLOAD took */
    if (f && f != l->self) l->found = f;
    return l->found != NULL;
}

/* The function the caller would have bound to without this library. First the caller's
 * own dependencies (dlsym on the caller's handle searches it and its DT_NEEDED libraries,
 * not the LD_PRELOAD one): the plugin's bundled libucp. Then RTLD_NEXT (a libucp in the
 * global scope), then any loaded libucp. Found once per hook, then cached. */
static void *real(int hook, void *self, void *caller) {
    void *f = __atomic_load_n(&real_fn[hook], __ATOMIC_ACQUIRE);
    if (f) return f;
    Dl_info info;
    if (dladdr(caller, &info) && info.dli_fname && *info.dli_fname) {
        void *h = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
        if (h) {
            f = dlsym(h, hook_names[hook]);
            dlclose(h);
        }
    }
    if (!f || f == self) f = dlsym(RTLD_NEXT, hook_names[hook]);
    if (!f || f == self) {
        struct lookup l = {hook_names[hook], self, NULL};
        dl_iterate_phdr(find_in_libucp, &l);
        f = l.found;
    }
    if (f == self) f = NULL;
    if (!f) say("cannot find the real %s: failing the call", hook_names[hook]);
    else __atomic_store_n(&real_fn[hook], f, __ATOMIC_RELEASE);
    return f;
}

/* Counts the call when its hook is enabled; returns the status to fail it with, or 0. */
static ucs_status_t fault_for(int hook) {
    if (!pattern_len || !hook_on[hook]) return 0;
    unsigned long i = __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED);
    if (pattern[(i - 1) % pattern_len] != 'X') {
        if (debug) say("%s call #%lu passes", hook_names[hook], i);
        return 0;
    }
    unsigned long k = __atomic_add_fetch(&faults, 1, __ATOMIC_RELAXED);
    ucs_status_t code = codes[(k - 1) % n_codes];
    say("[FAULT] INJECTED #%lu: %s call #%lu -> status %d", k, hook_names[hook], i, code);
    return code;
}

ucs_status_ptr_t ucp_get_nbx(ucp_ep_h ep, void *buffer, size_t count, uint64_t remote_addr,
                             ucp_rkey_h rkey, const ucp_request_param_t *param) {
    ucs_status_t st = fault_for(HOOK_GET);
    if (st) return UCS_STATUS_PTR(st);
    get_fn f = (get_fn)real(HOOK_GET, (void *)ucp_get_nbx, __builtin_return_address(0));
    return f ? f(ep, buffer, count, remote_addr, rkey, param) : UCS_STATUS_PTR(UCS_ERR_IO_ERROR);
}

ucs_status_ptr_t ucp_put_nbx(ucp_ep_h ep, const void *buffer, size_t count,
                             uint64_t remote_addr, ucp_rkey_h rkey,
                             const ucp_request_param_t *param) {
    ucs_status_t st = fault_for(HOOK_PUT);
    if (st) return UCS_STATUS_PTR(st);
    put_fn f = (put_fn)real(HOOK_PUT, (void *)ucp_put_nbx, __builtin_return_address(0));
    return f ? f(ep, buffer, count, remote_addr, rkey, param) : UCS_STATUS_PTR(UCS_ERR_IO_ERROR);
}

ucs_status_ptr_t ucp_ep_flush_nbx(ucp_ep_h ep, const ucp_request_param_t *param) {
    ucs_status_t st = fault_for(HOOK_FLUSH);
    if (st) return UCS_STATUS_PTR(st);
    flush_fn f = (flush_fn)real(HOOK_FLUSH, (void *)ucp_ep_flush_nbx,
                                __builtin_return_address(0));
    return f ? f(ep, param) : UCS_STATUS_PTR(UCS_ERR_IO_ERROR);
}
