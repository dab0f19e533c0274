// link_relay: the userspace link emulator of bench/wan (README.md). Creates TUN device DEV_A in
// network namespace NS_A and DEV_B in NS_B, prints "ready" on stdout, and relays packets between
// them with the given one-way delay, rate, queue and loss in each direction until SIGTERM/SIGINT;
// then prints one JSON line of counters per direction and one of its CPU time, and exits 0.
//   link_relay --ns-a /run/netns/A --dev-a wanA --ns-b /run/netns/B --dev-b wanB
//              [--delay-ms 25] [--rate-mbit 1000] [--queue-ms 50] [--loss 0] [--seed 1]
//              [--no-offload]
// The driver (run.py) assigns the addresses and brings the devices up.
#include <signal.h>
#include <sys/resource.h>
#include <sys/prctl.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "bench/wan/link_emulator.h"
#include "bench/wan/tun_relay.h"

namespace {

struct Args {
  std::string ns_a, dev_a, ns_b, dev_b;
  double delay_ms = 25, rate_mbit = 1000, queue_ms = 50, loss = 0;
  uint64_t seed = 1;
  bool offload = true;
};

[[noreturn]] void Usage(const std::string& why) {
  std::fprintf(stderr, "link_relay: %s\nusage: link_relay --ns-a PATH --dev-a NAME --ns-b PATH "
                       "--dev-b NAME [--delay-ms D] [--rate-mbit R] [--queue-ms Q] [--loss P] "
                       "[--seed S] [--no-offload]\n", why.c_str());
  std::exit(2);
}

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--no-offload") { a.offload = false; continue; }
    if (i + 1 >= argc) Usage(absl::StrCat(k, " needs a value"));
    const std::string v = argv[++i];
    bool ok = true;
    if (k == "--ns-a") a.ns_a = v;
    else if (k == "--dev-a") a.dev_a = v;
    else if (k == "--ns-b") a.ns_b = v;
    else if (k == "--dev-b") a.dev_b = v;
    else if (k == "--delay-ms") ok = absl::SimpleAtod(v, &a.delay_ms) && a.delay_ms >= 0;
    else if (k == "--rate-mbit") ok = absl::SimpleAtod(v, &a.rate_mbit) && a.rate_mbit > 0;
    else if (k == "--queue-ms") ok = absl::SimpleAtod(v, &a.queue_ms) && a.queue_ms > 0;
    else if (k == "--loss") ok = absl::SimpleAtod(v, &a.loss);
    else if (k == "--seed") ok = absl::SimpleAtoi(v, &a.seed);
    else Usage(absl::StrCat("unknown option ", k));
    if (!ok) Usage(absl::StrCat("bad value for ", k, ": ", v));
  }
  if (a.ns_a.empty() || a.dev_a.empty() || a.ns_b.empty() || a.dev_b.empty()) {
    Usage("--ns-a, --dev-a, --ns-b and --dev-b are required");
  }
  return a;
}

refit::wan::LinkOptions Options(const Args& a, uint64_t seed) {
  refit::wan::LinkOptions o;
  o.one_way_delay_ns = static_cast<uint64_t>(a.delay_ms * 1e6);
  o.rate_bits_per_s = static_cast<uint64_t>(a.rate_mbit * 1e6);
  o.queue_bytes = static_cast<uint64_t>(a.queue_ms / 1000.0 * a.rate_mbit * 1e6 / 8);
  o.loss = a.loss;
  o.seed = seed;
  auto r = refit::wan::ResolveLinkOptions(o);
  if (!r.ok()) Usage(std::string(r.status().message()));
  return *r;
}

void PrintCounters(const char* dir, const refit::wan::LinkQueue& q) {
  const refit::wan::LinkCounters& c = q.model().counters();
  std::printf("{\"direction\": \"%s\", \"packets\": %lu, \"bytes\": %lu, \"queue_drops\": %lu, "
              "\"loss_drops\": %lu, \"max_backlog_bytes\": %lu}\n",
              dir, c.accepted_packets, c.accepted_bytes, c.queue_drops, c.loss_drops,
              c.max_backlog_bytes);
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = Parse(argc, argv);
  prctl(PR_SET_TIMERSLACK, 1UL);  // ppoll wake-ups within ~1 us instead of the default 50 us
  auto a = refit::wan::OpenTunIn(args.ns_a, args.dev_a, args.offload);
  auto b = a.ok() ? refit::wan::OpenTunIn(args.ns_b, args.dev_b, args.offload) : a;
  if (!a.ok() || !b.ok()) {
    std::fprintf(stderr, "link_relay: %s\n", (a.ok() ? b : a).status().ToString().c_str());
    return 1;
  }
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);  // inherited by the relay threads
  refit::wan::LinkQueue a_to_b(Options(args, args.seed)), b_to_a(Options(args, args.seed + 1));
  std::atomic<bool> stop{false};
  std::atomic<int> failed{0};
  auto run = [&](int in, int out, refit::wan::LinkQueue* q) {
    const absl::Status s = refit::wan::RelayDirection(in, out, args.offload, q, &stop);
    if (!s.ok()) {
      std::fprintf(stderr, "link_relay: %s\n", s.ToString().c_str());
      failed = 1;
      kill(getpid(), SIGTERM);
    }
  };
  std::thread t1(run, a->fd, b->fd, &a_to_b), t2(run, b->fd, a->fd, &b_to_a);
  std::printf("ready\n");
  std::fflush(stdout);
  int sig = 0;
  sigwait(&set, &sig);
  stop = true;
  t1.join();
  t2.join();
  PrintCounters("a_to_b", a_to_b);
  PrintCounters("b_to_a", b_to_a);
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  std::printf("{\"cpu_user_s\": %.3f, \"cpu_sys_s\": %.3f}\n",
              ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6,
              ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6);
  return failed.load();
}
