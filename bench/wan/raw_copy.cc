// raw_copy: the raw TCP full-checkpoint reference of bench/wan (README.md). The same bytes as
// refitd's keyframe (a safetensors file) over N plain TCP streams, stream i carrying the i-th
// contiguous share; no TLS, no framing.
//   raw_copy recv --listen IP:PORT --streams N --bytes B     prints {"end_mono_ns": ...} when all
//                                                          B bytes arrived, then exits
//   raw_copy send --connect IP:PORT --streams N FILE        prints {"start_mono_ns": ...,
//                                                          "connected_mono_ns": ...}
// The driver runs the receiver in the subscriber's namespace and the sender in the publisher's;
// CLOCK_MONOTONIC is shared by both, so elapsed = end - start (connects included: a real copy
// pays them). Exit 0 on success, 1 on an I/O error, 2 on bad arguments.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace {

uint64_t MonoNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<uint64_t>(ts.tv_nsec);
}

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "raw_copy: %s: %s\n", what.c_str(), std::strerror(errno));
  std::exit(1);
}

[[noreturn]] void Usage() {
  std::fprintf(stderr, "usage: raw_copy recv --listen IP:PORT --streams N --bytes B\n"
                       "       raw_copy send --connect IP:PORT --streams N FILE\n");
  std::exit(2);
}

sockaddr_in Address(const std::string& hp) {
  const size_t colon = hp.rfind(':');
  if (colon == std::string::npos) Usage();
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(std::atoi(hp.c_str() + colon + 1)));
  if (inet_pton(AF_INET, hp.substr(0, colon).c_str(), &a.sin_addr) != 1) Usage();
  return a;
}

// Share [lo, hi) of stream i of n over `total` bytes.
void Share(uint64_t total, int i, int n, uint64_t* lo, uint64_t* hi) {
  *lo = total * static_cast<uint64_t>(i) / static_cast<uint64_t>(n);
  *hi = total * static_cast<uint64_t>(i + 1) / static_cast<uint64_t>(n);
}

int Recv(const std::string& listen_at, int streams, uint64_t total) {
  const int ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const sockaddr_in a = Address(listen_at);
  if (bind(ls, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) < 0) Die("bind " + listen_at);
  if (listen(ls, streams) < 0) Die("listen");
  std::printf("{\"listening\": true}\n");
  std::fflush(stdout);
  std::vector<uint8_t> sink(total);
  std::vector<std::thread> threads;
  for (int i = 0; i < streams; ++i) {
    const int fd = accept4(ls, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) Die("accept");
    threads.emplace_back([fd, &sink, total, streams] {
      uint32_t index = 0;  // the sender names its share first
      if (recv(fd, &index, sizeof(index), MSG_WAITALL) != sizeof(index)) Die("recv index");
      uint64_t lo, hi;
      Share(total, static_cast<int>(index % static_cast<uint32_t>(streams)), streams, &lo, &hi);
      while (lo < hi) {
        const ssize_t n = recv(fd, sink.data() + lo, hi - lo, 0);
        if (n <= 0) Die("recv");
        lo += static_cast<uint64_t>(n);
      }
      close(fd);
    });
  }
  for (std::thread& t : threads) t.join();
  std::printf("{\"end_mono_ns\": %lu, \"bytes\": %lu}\n", MonoNs(), total);
  return 0;
}

int Send(const std::string& to, int streams, const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  std::vector<char> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in.good() && !in.eof()) Die("read " + file);
  const uint64_t start = MonoNs();
  const sockaddr_in a = Address(to);
  std::vector<int> fds;
  for (int i = 0; i < streams; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) < 0) Die("connect " + to);
    fds.push_back(fd);
  }
  const uint64_t connected = MonoNs();
  std::vector<std::thread> threads;
  for (int i = 0; i < streams; ++i) {
    threads.emplace_back([&, i] {
      const uint32_t index = static_cast<uint32_t>(i);
      if (send(fds[i], &index, sizeof(index), 0) != sizeof(index)) Die("send index");
      uint64_t lo, hi;
      Share(data.size(), i, streams, &lo, &hi);
      while (lo < hi) {
        const ssize_t n = send(fds[i], data.data() + lo, hi - lo, MSG_NOSIGNAL);
        if (n <= 0) Die("send");
        lo += static_cast<uint64_t>(n);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int fd : fds) close(fd);
  std::printf("{\"start_mono_ns\": %lu, \"connected_mono_ns\": %lu, \"bytes\": %zu}\n", start,
              connected, data.size());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) Usage();
  const std::string mode = argv[1];
  std::string addr, file;
  int streams = 1;
  uint64_t bytes = 0;
  for (int i = 2; i < argc; ++i) {
    const std::string k = argv[i];
    if ((k == "--listen" || k == "--connect") && i + 1 < argc) addr = argv[++i];
    else if (k == "--streams" && i + 1 < argc) streams = std::atoi(argv[++i]);
    else if (k == "--bytes" && i + 1 < argc) bytes = std::strtoull(argv[++i], nullptr, 10);
    else if (k.rfind("--", 0) != 0) file = k;
    else Usage();
  }
  if (addr.empty() || streams < 1 || streams > 64) Usage();
  if (mode == "recv" && bytes > 0) return Recv(addr, streams, bytes);
  if (mode == "send" && !file.empty()) return Send(addr, streams, file);
  Usage();
}
