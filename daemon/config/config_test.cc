#include "daemon/config/config.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <utility>

#include "daemon/common/status_matchers.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"

namespace refit::config {
namespace {

using google::protobuf::util::MessageDifferencer;
using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

#define EXPECT_CONTAINS(haystack, needle)                          \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) \
      << "expected to find [" << (needle) << "] in [" << (haystack) << "]"

std::string PublisherError(const std::string& yaml) {
  auto c = LoadPublisherConfigFromString(yaml, "pub.yaml");
  if (c.ok()) return "";
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  EXPECT_EQ(c.status().message().find('\n'), std::string::npos) << c.status();
  return std::string(c.status().message());
}

std::string SubscriberError(const std::string& yaml) {
  auto c = LoadSubscriberConfigFromString(yaml, "sub.yaml");
  if (c.ok()) return "";
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  EXPECT_EQ(c.status().message().find('\n'), std::string::npos) << c.status();
  return std::string(c.status().message());
}

std::string WriteFile(const std::string& name, const std::string& text) {
  std::string path =
      ::testing::TempDir() + "refit_config_test_" + std::to_string(getpid()) + "_" + name;
  std::ofstream(path) << text;
  return path;
}

// A subscriber section around `extra` (indented two spaces) with a loopback upstream.
std::string Sub(const std::string& extra, const std::string& listen = "\"127.0.0.1:0\"") {
  return "subscriber:\n  upstream:\n    addresses: [\"127.0.0.2:7400\"]\n  listen: " + listen +
         "\n" + extra;
}

const std::string kPubListen = "publisher:\n  listen: \"127.0.0.1:0\"\n";

constexpr char kTlsServer[] =
    "    cert: /etc/r/s.crt\n    key: /etc/r/s.key\n    ca: /etc/r/ca.crt\n";

// ---- valid configs ---------------------------------------------------------------------------

TEST(ConfigTest, MinimalPublisherGetsDefaults) {
  REFIT_ASSERT_OK_AND_ASSIGN(
      auto c, LoadPublisherConfigFromString("publisher:\n  listen: \"127.0.0.1:0\"\n"));
  EXPECT_EQ(c.listen(), "127.0.0.1:0");
  EXPECT_EQ(c.name(), "");
  EXPECT_EQ(c.log_level(), v1::LOG_LEVEL_INFO);
  EXPECT_EQ(c.control_listen(), "");
  EXPECT_EQ(c.transport().frame_bytes(), 4u << 20);
  EXPECT_EQ(c.transport().max_streams_per_subscriber(), 8u);
  EXPECT_EQ(c.transport().keepalive_time_ms(), 10000u);
  EXPECT_EQ(c.transport().stream_window_bytes(), 32u << 20);
  EXPECT_EQ(c.transport().single_stream_below_bytes(), 0u);
  EXPECT_EQ(c.history().memory_budget_bytes(), 4ull << 30);
  EXPECT_EQ(c.history().max_versions(), 64u);
  EXPECT_EQ(c.baseline().persist_dir(), "");
  EXPECT_TRUE(c.baseline().fsync());
  EXPECT_EQ(c.baseline().compact_log_versions(), 64u);
  EXPECT_EQ(c.baseline().compact_log_bytes(), 1ull << 30);
  EXPECT_EQ(c.baseline().max_queued_versions(), 8u);
  EXPECT_EQ(c.baseline().max_queued_bytes(), 1ull << 30);
  EXPECT_EQ(c.publish_queue().max_pending(), 16u);
  EXPECT_EQ(c.codec().block_log2(), 18u);
  EXPECT_EQ(c.codec().device(), v1::DEVICE_CPU);
  EXPECT_FALSE(c.tls().insecure());
  EXPECT_DOUBLE_EQ(c.publish_guard().max_removed_tensor_fraction(), 0.5);
  EXPECT_DOUBLE_EQ(c.publish_guard().max_removed_byte_fraction(), 0.5);
}

TEST(ConfigTest, MinimalSubscriberGetsDefaults) {
  REFIT_ASSERT_OK_AND_ASSIGN(auto c, LoadSubscriberConfigFromString(Sub("")));
  EXPECT_EQ(c.upstream().connections(), 4u);
  EXPECT_TRUE(c.upstream().stream_progress());
  EXPECT_EQ(c.upstream().max_frame_bytes(), 16u << 20);
  EXPECT_EQ(c.upstream().backoff().initial_ms(), 100u);
  EXPECT_EQ(c.upstream().backoff().max_ms(), 10000u);
  EXPECT_DOUBLE_EQ(c.upstream().backoff().multiplier(), 2.0);
  EXPECT_DOUBLE_EQ(c.upstream().backoff().jitter(), 0.2);
  EXPECT_FALSE(c.serve_peers());
  EXPECT_EQ(c.store().kind(), v1::STORE_KIND_SHM);
  EXPECT_EQ(c.store().shm_prefix(), "/refitd-");
  EXPECT_EQ(c.store().slots(), 2u);
  EXPECT_EQ(c.staging().max_bytes(), 0u);
  EXPECT_EQ(c.leases().default_ttl_ms(), 60000u);
  EXPECT_EQ(c.leases().max_ttl_ms(), 600000u);
  EXPECT_EQ(c.leases().max_leases_per_consumer(), 64u);
  EXPECT_FALSE(c.store().allow_unsealed());
  EXPECT_EQ(c.store().retained_patch_bytes(), 256u << 20);
  EXPECT_TRUE(c.store().prefault());
  EXPECT_EQ(c.store().scrub_bytes_per_second(), 256u << 20);
  EXPECT_EQ(c.store().scrub_interval_ms(), 300000u);
  EXPECT_TRUE(c.refresh_standby());
  EXPECT_EQ(c.refresh_wait_ms(), 10000u);
  EXPECT_EQ(c.refresh_copy_density(), 0.01);
  EXPECT_TRUE(c.refresh_copy_lines());
  EXPECT_EQ(c.background_nice(), 10u);
}

constexpr char kFullPublisher[] = R"(# a full publisher
publisher:
  name: trainer-a
  log_level: debug
  listen: "0.0.0.0:7400"
  tls:
    cert: /etc/r/p.crt
    key: /etc/r/p.key
    ca: /etc/r/ca.crt
    allowed_identities: [sub-0, "spiffe://cluster/sub"]
  control_listen: "127.0.0.2:7401"
  local_socket: /run/refitd/p.sock
  ready_file: /run/refitd/p.ready
  transport:
    frame_bytes: 1048576
    max_streams_per_subscriber: 16
    max_subscribers: 10
    stripe_join_timeout_ms: 500
    keepalive_time_ms: 2000
    keepalive_timeout_ms: 4000
  history: {memory_budget_bytes: 0, max_versions: 0}
  baseline: {persist_dir: /var/lib/refitd, fsync: false}
  codec: {block_log2: 16, threads: 2, device: cuda, cuda_device: 1}
)";

constexpr char kFullSubscriber[] = R"(subscriber:
  name: rollout-0
  log_level: warn
  upstream:
    addresses: ["pub.example.com:7400", "dns:///pub2.example.com:7400"]
    bootstrap_peers: ["10.0.0.8:7410"]
    tls: {cert: /c.crt, key: /c.key, ca: /ca.crt, server_name: pub.example.com}
    connections: 8
    max_frame_bytes: 8388608
    connect_timeout_ms: 3000
    keepalive_time_ms: 5000
    keepalive_timeout_ms: 5000
    backoff: {initial_ms: 10, max_ms: 1000, multiplier: 1.5, jitter: 0.1}
  listen: "[::]:7410"
  tls: {cert: /s.crt, key: /s.key, ca: /ca.crt}
  serve_peers: true
  control_listen: "unix:///run/refitd/s-control.sock"
  local_socket: /run/refitd/s.sock
  ready_file: /tmp/s.ready
  store: {kind: cuda, shm_prefix: /rf-, slots: 4, cuda_device: 0}
  staging: {max_bytes: 1000000, threads: 3}
  leases: {default_ttl_ms: 1000, max_ttl_ms: 2000, max_leases: 5}
)";

TEST(ConfigTest, FullConfigsLoadAndRoundTrip) {
  REFIT_ASSERT_OK_AND_ASSIGN(auto p, LoadPublisherConfigFromString(kFullPublisher));
  EXPECT_EQ(p.tls().allowed_identities_size(), 2);
  EXPECT_EQ(p.codec().cuda_device(), 1u);
  EXPECT_EQ(p.history().memory_budget_bytes(), 0u);
  auto p2 = LoadPublisherConfigFromString(ConfigToYaml(p));
  ASSERT_THAT(p2, IsOk()) << p2.status() << "\n" << ConfigToYaml(p);
  EXPECT_TRUE(MessageDifferencer::Equals(p, *p2));

  REFIT_ASSERT_OK_AND_ASSIGN(auto s, LoadSubscriberConfigFromString(kFullSubscriber));
  EXPECT_EQ(s.store().kind(), v1::STORE_KIND_CUDA);
  EXPECT_EQ(s.upstream().tls().server_name(), "pub.example.com");
  REFIT_ASSERT_OK_AND_ASSIGN(auto s2, LoadSubscriberConfigFromString(ConfigToYaml(s)));
  EXPECT_TRUE(MessageDifferencer::Equals(s, s2));
}

TEST(ConfigTest, ASingleCopyStoreRoundTripsWithItsScrubOff) {
  // store.slots 1 turns the scrub off unless given: the loaded config says 0, so that the config
  // written out loads back (an explicit non-zero rate with one slot is refused).
  REFIT_ASSERT_OK_AND_ASSIGN(auto s, LoadSubscriberConfigFromString(Sub("  store: {slots: 1}\n")));
  EXPECT_EQ(s.store().scrub_bytes_per_second(), 0u);
  auto s2 = LoadSubscriberConfigFromString(ConfigToYaml(s));
  ASSERT_THAT(s2, IsOk()) << ConfigToYaml(s);
  EXPECT_TRUE(MessageDifferencer::Equals(s, *s2));
  REFIT_ASSERT_OK_AND_ASSIGN(auto two,
                             LoadSubscriberConfigFromString(Sub("  store: {slots: 2}\n")));
  EXPECT_EQ(two.store().scrub_bytes_per_second(), 268435456u);
}

TEST(ConfigTest, OneFileForBothRoles) {
  const std::string both = std::string(kFullPublisher) + kFullSubscriber;
  EXPECT_THAT(LoadPublisherConfigFromString(both), IsOk());
  EXPECT_THAT(LoadSubscriberConfigFromString(both), IsOk());
  REFIT_ASSERT_OK_AND_ASSIGN(auto file, LoadConfigFileFromString(both));
  EXPECT_TRUE(file.has_publisher() && file.has_subscriber());
  // The other role's section is still schema-checked...
  EXPECT_CONTAINS(PublisherError(std::string(kFullPublisher) + "subscriber: {bogus: 1}\n"),
                  "subscriber.bogus: unknown key");
  // ...but not semantically: a publisher starts even if the subscriber section is inconsistent.
  const std::string bad_sub = Sub("", "\"0.0.0.0:1\"");
  EXPECT_THAT(LoadPublisherConfigFromString(std::string(kFullPublisher) + bad_sub), IsOk());
  EXPECT_THAT(LoadConfigFileFromString(std::string(kFullPublisher) + bad_sub), Not(IsOk()));
}

TEST(ConfigTest, WrongOrMissingSection) {
  EXPECT_CONTAINS(PublisherError(Sub("")),
                  "pub.yaml: no 'publisher:' section (the file configures a subscriber)");
  EXPECT_CONTAINS(SubscriberError("publisher: {listen: \"127.0.0.1:1\"}\n"),
                  "sub.yaml: no 'subscriber:' section (the file configures a publisher)");
  EXPECT_CONTAINS(PublisherError("listen: \"127.0.0.1:1\"\n"),
                  "pub.yaml:1:1: listen: unknown key; expected one of: publisher, subscriber");
  EXPECT_CONTAINS(PublisherError("publisher:\n"), "publisher: expected a mapping, got null");
}

// ---- addresses and TLS rules -----------------------------------------------------------------

TEST(ConfigTest, NonLoopbackListenNeedsTls) {
  EXPECT_EQ(PublisherError("publisher:\n  listen: \"0.0.0.0:7000\"\n"),
            "pub.yaml:2:11: publisher.listen: \"0.0.0.0:7000\" is not a loopback address, so "
            "publisher.tls needs cert, key and ca (mTLS), or set publisher.tls.insecure: true "
            "explicitly");
  EXPECT_CONTAINS(PublisherError("publisher:\n  listen: \"pub.example.com:7000\"\n"),
                  "is not a loopback address");
  EXPECT_CONTAINS(PublisherError("publisher:\n  listen: \"[::]:7000\"\n"),
                  "is not a loopback address");
  // Explicit plaintext.
  EXPECT_EQ(PublisherError("publisher:\n  listen: \"0.0.0.0:7000\"\n  tls: {insecure: true}\n"),
            "");
  // TLS.
  EXPECT_EQ(
      PublisherError(std::string("publisher:\n  listen: \"0.0.0.0:7000\"\n  tls:\n") + kTlsServer),
      "");
  // Loopback needs nothing, in every form.
  for (const char* addr : {"127.0.0.2:7000", "127.3.2.1:7000", "[::1]:7000", "localhost:700",
                           "unix:/tmp/x.sock", "unix:///tmp/x.sock"}) {
    EXPECT_EQ(PublisherError(std::string("publisher:\n  listen: \"") + addr + "\"\n"), "") << addr;
  }
}

TEST(ConfigTest, TlsBlocksMustBeConsistent) {
  EXPECT_CONTAINS(PublisherError("publisher:\n  listen: \"0.0.0.0:7000\"\n  tls:\n"
                                 "    insecure: true\n    cert: /a.crt\n"),
                  "pub.yaml:4:15: publisher.tls.insecure: true cannot be combined with cert, key, "
                  "ca or allowed_identities");
  EXPECT_CONTAINS(PublisherError("publisher:\n  listen: \"0.0.0.0:7000\"\n  tls:\n"
                                 "    cert: /a.crt\n    key: /a.key\n"),
                  "pub.yaml:4:5: publisher.tls.ca: required together with cert and key (TLS "
                  "listeners are mTLS");
  // Partial TLS is an error on loopback too.
  EXPECT_CONTAINS(PublisherError("publisher:\n  listen: \"127.0.0.2:7000\"\n  tls: {ca: /ca}\n"),
                  "publisher.tls.cert: required together with ca");
  EXPECT_CONTAINS(PublisherError("publisher:\n  listen: \"127.0.0.2:7000\"\n"
                                 "  tls: {allowed_identities: [x]}\n"),
                  "publisher.tls.allowed_identities: needs TLS");
  EXPECT_CONTAINS(PublisherError(std::string("publisher:\n  listen: \"0.0.0.0:7000\"\n  tls:\n") +
                                 kTlsServer + "    allowed_identities: [\"\"]\n"),
                  "publisher.tls.allowed_identities[0]: must not be empty");
}

TEST(ConfigTest, ControlListener) {
  EXPECT_CONTAINS(PublisherError("publisher:\n  listen: \"127.0.0.1:1\"\n"
                                 "  control_listen: \"0.0.0.0:2\"\n"),
                  "pub.yaml:3:19: publisher.control_listen: \"0.0.0.0:2\" is not a loopback "
                  "address, so publisher.control_tls needs cert");
  EXPECT_CONTAINS(PublisherError("publisher:\n  listen: \"127.0.0.1:1\"\n"
                                 "  control_tls: {insecure: true}\n"),
                  "publisher.control_tls: is set, but control_listen is empty");
  EXPECT_CONTAINS(PublisherError("publisher:\n  listen: \"127.0.0.1:7\"\n"
                                 "  control_listen: \"127.0.0.1:7\"\n"),
                  "publisher.control_listen: uses the same address as publisher.listen");
  EXPECT_CONTAINS(PublisherError("publisher:\n  listen: \"unix:/tmp/a.sock\"\n"
                                 "  local_socket: /tmp/a.sock\n"),
                  "publisher.local_socket: uses the same address as publisher.listen");
  // Port 0 twice is fine: the OS picks two ports.
  EXPECT_EQ(PublisherError("publisher:\n  listen: \"127.0.0.1:0\"\n"
                           "  control_listen: \"127.0.0.1:0\"\n"),
            "");
}

TEST(ConfigTest, MetricsListener) {
  // Off by default; loopback TCP with port 0 is fine on both roles.
  REFIT_ASSERT_OK_AND_ASSIGN(auto pub, LoadPublisherConfigFromString(kPubListen, "pub.yaml"));
  EXPECT_EQ(pub.metrics().listen(), "");
  EXPECT_EQ(pub.metrics().max_session_series(), 16u);
  EXPECT_EQ(PublisherError(kPubListen + "  metrics: {listen: \"127.0.0.1:0\"}\n"), "");
  EXPECT_EQ(SubscriberError(Sub("  metrics: {listen: \"[::1]:0\"}\n")), "");
  // No TLS on the endpoint: a non-loopback address needs insecure: true, named by field.
  EXPECT_EQ(PublisherError(kPubListen + "  metrics:\n    listen: \"0.0.0.0:9400\"\n"),
            "pub.yaml:4:13: publisher.metrics.listen: \"0.0.0.0:9400\" is not a loopback "
            "address, and the metrics endpoint has no TLS: use a loopback address, or set "
            "publisher.metrics.insecure: true explicitly");
  EXPECT_EQ(PublisherError(kPubListen +
                           "  metrics: {listen: \"0.0.0.0:9400\", insecure: true}\n"),
            "");
  EXPECT_CONTAINS(SubscriberError(Sub("  metrics: {insecure: true}\n")),
                  "subscriber.metrics.insecure: is true, but metrics.listen is empty");
  // HTTP over TCP only; bad syntax and collisions name the field.
  EXPECT_CONTAINS(SubscriberError(Sub("  metrics: {listen: \"unix:/tmp/m.sock\"}\n")),
                  "subscriber.metrics.listen: \"unix:/tmp/m.sock\": the metrics endpoint is "
                  "HTTP over TCP");
  EXPECT_CONTAINS(PublisherError(kPubListen + "  metrics: {listen: \"127.0.0.1\"}\n"),
                  "publisher.metrics.listen: \"127.0.0.1\":");
  EXPECT_CONTAINS(PublisherError("publisher:\n  listen: \"127.0.0.1:7\"\n"
                                 "  metrics: {listen: \"127.0.0.1:7\"}\n"),
                  "publisher.metrics.listen: uses the same address as publisher.listen");
  EXPECT_CONTAINS(PublisherError(kPubListen + "  metrics: {max_session_series: 1001}\n"),
                  "publisher.metrics.max_session_series");
}

TEST(ConfigTest, AddressSyntaxErrorsNameTheField) {
  EXPECT_EQ(PublisherError("publisher:\n  listen: \"0.0.0.0\"\n"),
            "pub.yaml:2:11: publisher.listen: \"0.0.0.0\": missing ':port' (write host:port, "
            "[ipv6]:port or unix:/path)");
  EXPECT_CONTAINS(PublisherError("publisher:\n  listen: \"127.0.0.2:99999\"\n"),
                  "publisher.listen: \"127.0.0.2:99999\": port 99999 is out of range (0..65535)");
  EXPECT_CONTAINS(SubscriberError("subscriber:\n  listen: \"127.0.0.1:0\"\n  upstream:\n"
                                  "    addresses: [\"127.0.0.1:1\", \"127.0.0.1:0\"]\n"),
                  "sub.yaml:4:32: subscriber.upstream.addresses[1]: \"127.0.0.1:0\": port 0 is "
                  "out of range (1..65535; 0 is only for listening)");
  EXPECT_CONTAINS(PublisherError("publisher:\n  listen: \"dns:///x:1\"\n"),
                  "scheme prefixes (dns:, ipv4:, ipv6:) are for connections");
}

TEST(ConfigTest, SubscriberUpstreamNeedsMutualTls) {
  const std::string upstream =
      "subscriber:\n  listen: \"127.0.0.1:0\"\n  upstream:\n"
      "    addresses: [\"127.0.0.2:7400\", \"pub.example.com:7400\"]\n";
  EXPECT_EQ(SubscriberError(upstream),
            "sub.yaml:4:35: subscriber.upstream.addresses[1]: \"pub.example.com:7400\" is not a "
            "loopback address, so subscriber.upstream.tls needs cert, key and ca (mTLS), or set "
            "subscriber.upstream.tls.insecure: true explicitly");
  EXPECT_EQ(SubscriberError(upstream + "    tls: {insecure: true}\n"), "");
  EXPECT_EQ(SubscriberError(upstream + "    tls: {cert: /c, key: /k, ca: /ca}\n"), "");
  // A client certificate is mandatory with TLS.
  EXPECT_CONTAINS(SubscriberError(upstream + "    tls: {ca: /ca}\n"),
                  "subscriber.upstream.tls.cert: required for TLS connections with ca "
                  "(subscribers present a client certificate");
  EXPECT_CONTAINS(SubscriberError(upstream + "    tls: {server_name: pub}\n"),
                  "subscriber.upstream.tls.cert: required for TLS connections (");
  EXPECT_CONTAINS(SubscriberError(upstream + "    tls: {insecure: true, server_name: x}\n"),
                  "subscriber.upstream.tls.insecure: true cannot be combined");
  // Bootstrap peers are connections too.
  EXPECT_CONTAINS(SubscriberError(Sub("") + "  upstream:\n    addresses: [\"127.0.0.1:1\"]\n"),
                  "duplicate key");
  EXPECT_CONTAINS(
      SubscriberError("subscriber:\n  listen: \"127.0.0.1:0\"\n  upstream:\n"
                      "    addresses: [\"127.0.0.1:1\"]\n    bootstrap_peers: [\"10.1.1.1:2\"]\n"),
      "subscriber.upstream.bootstrap_peers[0]: \"10.1.1.1:2\" is not a loopback address");
  EXPECT_CONTAINS(
      SubscriberError("subscriber:\n  listen: \"127.0.0.1:0\"\n  upstream:\n"
                      "    addresses: [\"127.0.0.1:1\"]\n    bootstrap_peers: [\"127.0.0.1:1\"]\n"),
      "subscriber.upstream.bootstrap_peers[0]: \"127.0.0.1:1\" is listed twice (also "
      "subscriber.upstream.addresses[0])");
}

TEST(ConfigTest, SubscriberListeners) {
  EXPECT_CONTAINS(SubscriberError("subscriber:\n  upstream: {addresses: [\"127.0.0.1:1\"]}\n"),
                  "subscriber.listen: set listen or control_listen");
  EXPECT_EQ(SubscriberError("subscriber:\n  upstream: {addresses: [\"127.0.0.1:1\"]}\n"
                            "  control_listen: \"unix:/tmp/c.sock\"\n"),
            "");
  EXPECT_CONTAINS(SubscriberError("subscriber:\n  upstream: {addresses: [\"127.0.0.1:1\"]}\n"
                                  "  control_listen: \"unix:/tmp/c.sock\"\n  serve_peers: true\n"),
                  "subscriber.serve_peers: true needs a listen address");
  EXPECT_CONTAINS(SubscriberError("subscriber:\n  upstream: {addresses: [\"127.0.0.1:1\"]}\n"
                                  "  control_listen: \"unix:/tmp/c.sock\"\n"
                                  "  tls: {insecure: true}\n"),
                  "subscriber.tls: is set, but listen is empty");
  EXPECT_CONTAINS(SubscriberError(Sub("", "\"0.0.0.0:7410\"")),
                  "subscriber.listen: \"0.0.0.0:7410\" is not a loopback address, so "
                  "subscriber.tls needs cert, key and ca (mTLS)");
  EXPECT_EQ(SubscriberError(Sub(std::string("  tls:\n") + kTlsServer, "\"0.0.0.0:7410\"")), "");
}

TEST(ConfigTest, LocalSocket) {
  EXPECT_CONTAINS(PublisherError("publisher:\n  listen: \"127.0.0.1:1\"\n"
                                 "  local_socket: \"unix:/tmp/x.sock\"\n"),
                  "publisher.local_socket: \"unix:/tmp/x.sock\": give a filesystem path, not a "
                  "gRPC address");
  EXPECT_CONTAINS(PublisherError("publisher:\n  listen: \"127.0.0.1:1\"\n  local_socket: /" +
                                 std::string(120, 'a') + "\n"),
                  "publisher.local_socket: unix socket path is 121 bytes; the limit is 107");
}

// ---- other cross-field rules -----------------------------------------------------------------

TEST(ConfigTest, SingleCopyStoreNeedsDigestV2AndNoSecondSlotFeatures) {
  EXPECT_EQ(SubscriberError(Sub("") + "  store: {slots: 1, digest_v2: true}\n"), "");
  EXPECT_EQ(SubscriberError(Sub("") + "  store: {slots: 1, digest_v2: true, kind: cuda, "
                                      "single_copy_staging_bytes: 0, pause_wait_ms: 0}\n"),
            "");
  // digest_v2 defaults to true: only an explicit false is refused.
  EXPECT_EQ(SubscriberError(Sub("") + "  store: {slots: 1}\n"), "");
  EXPECT_CONTAINS(SubscriberError(Sub("") + "  store: {slots: 1, digest_v2: false}\n"),
                  "subscriber.store.slots: 1 (a single copy, updated in place) verifies every "
                  "version from tensor digest v2 before writing it: store.digest_v2 must be true "
                  "(its default)");
  EXPECT_CONTAINS(
      SubscriberError(Sub("") + "  serve_peers: true\n  store: {slots: 1, digest_v2: true}\n"),
      "subscriber.serve_peers: true cannot be combined with store.slots 1");
  EXPECT_CONTAINS(SubscriberError(Sub("") + "  store: {slots: 1, digest_v2: true, "
                                            "scrub_bytes_per_second: 1000}\n"),
                  "subscriber.store.scrub_bytes_per_second: the scrub repairs a damaged version "
                  "into a second slot");
  EXPECT_EQ(SubscriberError(Sub("") + "  store: {slots: 1, digest_v2: true, "
                                      "scrub_bytes_per_second: 0}\n"),
            "");
  EXPECT_CONTAINS(SubscriberError(Sub("") + "  store: {slots: 1, digest_v2: true, "
                                            "pause_wait_ms: 86400001}\n"),
                  "subscriber.store.pause_wait_ms: 86400001 is out of range");
}

TEST(ConfigTest, SubscriberRules) {
  EXPECT_CONTAINS(SubscriberError(Sub("") + "  store: {shm_prefix: refit}\n"),
                  "subscriber.store.shm_prefix: \"refit\": a POSIX shm name prefix starts with "
                  "'/'");
  EXPECT_CONTAINS(SubscriberError(Sub("") + "  store: {shm_prefix: /a/b}\n"), "no other '/'");
  EXPECT_CONTAINS(SubscriberError(Sub("") + "  store: {cuda_device: 0}\n"),
                  "subscriber.store.cuda_device: is set, but store.kind is not cuda");
  // The GPU by UUID: nvidia-smi's spelling, only with kind cuda, not together with the ordinal.
  EXPECT_EQ(SubscriberError(Sub("") + "  store: {kind: cuda, cuda_device_uuid: "
                                      "GPU-8b1f0011-2233-4455-6677-8899aabbccdd}\n"),
            "");
  // (That the UUID is one, "GPU-12" is not: daemon/runtime/daemon_config_test.cc.)
  EXPECT_CONTAINS(SubscriberError(Sub("") + "  store: {cuda_device_uuid: "
                                            "GPU-8b1f0011-2233-4455-6677-8899aabbccdd}\n"),
                  "subscriber.store.cuda_device_uuid: is set, but store.kind is not cuda");
  EXPECT_CONTAINS(SubscriberError(Sub("") + "  store: {kind: cuda, cuda_device: 0, "
                                            "cuda_device_uuid: "
                                            "GPU-8b1f0011-2233-4455-6677-8899aabbccdd}\n"),
                  "by ordinal or by UUID, not both");
  EXPECT_CONTAINS(SubscriberError(Sub("") + "  store: {slots: 0}\n"),
                  "subscriber.store.slots: 0 is out of range [1, 16]");
  EXPECT_CONTAINS(SubscriberError(Sub("") + "  store: {scrub_interval_ms: 0}\n"),
                  "subscriber.store.scrub_interval_ms: 0 is out of range");
  EXPECT_CONTAINS(SubscriberError(Sub("") + "  refresh_wait_ms: 600001\n"),
                  "subscriber.refresh_wait_ms: 600001 is out of range");
  EXPECT_CONTAINS(SubscriberError(Sub("") + "  refresh_copy_density: 1.5\n"),
                  "subscriber.refresh_copy_density: 1.5 is out of range");
  EXPECT_CONTAINS(SubscriberError(Sub("") + "  background_nice: 20\n"),
                  "subscriber.background_nice: 20 is out of range [0, 19]");
  EXPECT_CONTAINS(SubscriberError(Sub("") + "  store: {retained_patch_bytes: 68719476737}\n"),
                  "subscriber.store.retained_patch_bytes: 68719476737 is out of range "
                  "[0, 68719476736]");
  EXPECT_CONTAINS(SubscriberError(Sub("") + "  leases: {default_ttl_ms: 5000, max_ttl_ms: 10}\n"),
                  "subscriber.leases.default_ttl_ms: 5000 exceeds leases.max_ttl_ms (10)");
  EXPECT_CONTAINS(
      SubscriberError("subscriber:\n  listen: \"127.0.0.1:0\"\n  upstream:\n"
                      "    addresses: [\"127.0.0.1:1\"]\n    backoff: {initial_ms: 20000}\n"),
      "sub.yaml:5:27: subscriber.upstream.backoff.initial_ms: 20000 exceeds backoff.max_ms "
      "(10000)");
  EXPECT_CONTAINS(SubscriberError("subscriber:\n  listen: \"127.0.0.1:0\"\n  upstream:\n"
                                  "    addresses: [\"127.0.0.1:1\"]\n    connections: 0\n"),
                  "subscriber.upstream.connections: 0 is out of range [1, 64]");
}

TEST(ConfigTest, PublisherRules) {
  EXPECT_CONTAINS(PublisherError("publisher:\n  listen: \"127.0.0.1:1\"\n"
                                 "  codec: {cuda_device: 1}\n"),
                  "publisher.codec.cuda_device: is set, but codec.device is cpu");
  EXPECT_EQ(PublisherError("publisher:\n  listen: \"127.0.0.1:1\"\n"
                           "  codec: {device: auto, cuda_device: 1}\n"),
            "");
  // (A cuda_device_uuid that is not a UUID: daemon/runtime/daemon_config_test.cc.)
  EXPECT_CONTAINS(PublisherError("publisher:\n  listen: \"127.0.0.1:1\"\n"
                                 "  codec: {cuda_device_uuid: GPU-8b1f0011-2233-4455-6677-"
                                 "8899aabbccdd}\n"),
                  "publisher.codec.cuda_device_uuid: is set, but codec.device is cpu");
  EXPECT_EQ(PublisherError("publisher:\n  listen: \"127.0.0.1:1\"\n"
                           "  codec: {device: cuda, gpu_baseline: pinned}\n"),
            "");
  EXPECT_EQ(PublisherError("publisher:\n  listen: \"127.0.0.1:1\"\n"
                           "  codec: {patch_format: v2}\n"),
            "");
  EXPECT_EQ(PublisherError("publisher:\n  listen: \"127.0.0.1:1\"\n"
                           "  codec: {device: auto, patch_format: v2}\n"),
            "");
  // The GPU encoder writes format 2 too (cuda/context.cuh).
  EXPECT_EQ(PublisherError("publisher:\n  listen: \"127.0.0.1:1\"\n"
                           "  codec: {device: cuda, patch_format: v2}\n"),
            "");
  EXPECT_EQ(PublisherError("publisher:\n  listen: \"127.0.0.1:1\"\n"
                           "  codec: {device: cuda, patch_format: auto}\n"),
            "");
  EXPECT_EQ(PublisherError("publisher:\n  listen: \"127.0.0.1:1\"\n"
                           "  codec: {device: auto, patch_format: auto}\n"),
            "");
  EXPECT_CONTAINS(PublisherError("publisher:\n  listen: \"127.0.0.1:1\"\n"
                                 "  codec: {patch_format: v3}\n"),
                  "patch_format");
  EXPECT_CONTAINS(PublisherError("publisher:\n  listen: \"127.0.0.1:1\"\n"
                                 "  transport: {frame_bytes: 100}\n"),
                  "pub.yaml:3:28: publisher.transport.frame_bytes: 100 is out of range [65536, "
                  "67108864]");
  EXPECT_CONTAINS(PublisherError("publisher:\n  listen: \"127.0.0.1:1\"\n"
                                 "  history: {memory_budget_bytes: -1}\n"),
                  "publisher.history.memory_budget_bytes: -1 is out of range for an unsigned "
                  "64-bit integer");
}

TEST(ConfigTest, ShardRules) {
  const std::string& pub = kPubListen;
  EXPECT_EQ(PublisherError(pub + "  shard: {set: policy-7, index: 2, count: 3}\n"), "");
  EXPECT_CONTAINS(PublisherError(pub + "  shard: {set: policy, index: 3, count: 3}\n"),
                  "publisher.shard.index: 3 is not below shard.count (3)");
  EXPECT_CONTAINS(PublisherError(pub + "  shard: {index: 1, count: 3}\n"),
                  "publisher.shard.set: is 0 bytes");
  EXPECT_CONTAINS(PublisherError(pub + "  shard: {set: \"a b\", count: 2}\n"),
                  "publisher.shard.set: \"a b\": byte 1 is not a letter");
  EXPECT_CONTAINS(PublisherError(pub + "  shard: {set: policy}\n"),
                  "publisher.shard.count: is 0 (not sharded) but shard.set or shard.index is set");
  EXPECT_CONTAINS(PublisherError(pub + "  shard: {set: policy, count: 1025}\n"),
                  "publisher.shard.count: 1025 is out of range");

  const std::string head = "subscriber:\n  listen: \"127.0.0.1:0\"\n  upstream:\n";
  const std::string shards =
      "    shards:\n    - addresses: [\"127.0.0.1:7400\", \"127.0.0.1:7410\"]\n"
      "    - addresses: [\"127.0.0.1:7401\"]\n";
  REFIT_ASSERT_OK_AND_ASSIGN(auto ok, LoadSubscriberConfigFromString(
                                          head + shards + "    shard_set: policy\n", "sub.yaml"));
  EXPECT_EQ(ok.upstream().shards_size(), 2);
  EXPECT_CONTAINS(SubscriberError(head + shards), "subscriber.upstream.shard_set: is 0 bytes");
  EXPECT_CONTAINS(SubscriberError(head + shards + "    shard_set: policy\n"
                                  "    addresses: [\"127.0.0.1:7400\"]\n"),
                  "subscriber.upstream.shards: is set together with upstream.addresses");
  EXPECT_CONTAINS(SubscriberError(head + "    shard_set: policy\n"),
                  "subscriber.upstream.addresses: at least one address is required");
  EXPECT_CONTAINS(SubscriberError(head + "    addresses: [\"127.0.0.1:7400\"]\n"
                                  "    shard_set: policy\n"),
                  "subscriber.upstream.shard_set: is set but upstream.shards is empty");
  EXPECT_CONTAINS(SubscriberError(head + shards + "    shard_set: policy\n"
                                  "    bootstrap_peers: [\"127.0.0.1:7500\"]\n"),
                  "subscriber.upstream.bootstrap_peers: is not supported with upstream.shards");
  // A selection with shards: every shard's publisher is asked for its part of it.
  auto sel = LoadSubscriberConfigFromString(
      head + shards + "    shard_set: policy\n    tensors: [\"layers.*\"]\n", "sub.yaml");
  ASSERT_THAT(sel, IsOk());
  EXPECT_EQ(sel->upstream().tensors_size(), 1);
  // (An invalid selection, a pattern given twice: daemon/runtime/daemon_config_test.cc.)
  // A shard's addresses are checked like the others, under their own key.
  EXPECT_CONTAINS(SubscriberError(head + "    shards:\n    - addresses: [\"10.0.0.1:7400\"]\n"
                                  "    shard_set: policy\n"),
                  "subscriber.upstream.shards[0].addresses[0]");
  EXPECT_CONTAINS(SubscriberError(head + "    shards:\n    - addresses: []\n"
                                  "    shard_set: policy\n"),
                  "addresses");
}

TEST(ConfigTest, SliceRules) {
  const std::string head =
      "subscriber:\n  listen: \"127.0.0.1:0\"\n  upstream:\n"
      "    addresses: [\"127.0.0.1:7400\"]\n";
  REFIT_ASSERT_OK_AND_ASSIGN(
      auto ok, LoadSubscriberConfigFromString(head + "    slice: {rank: 1, ranks: 2}\n", "s.yaml"));
  EXPECT_EQ(ok.upstream().slice().rank(), 1u);
  EXPECT_EQ(ok.upstream().slice().ranks(), 2u);
  EXPECT_CONTAINS(SubscriberError(head + "    slice: {rank: 2, ranks: 2}\n"),
                  "subscriber.upstream.slice.rank: 2 is not below slice.ranks (2)");
  EXPECT_CONTAINS(SubscriberError(head + "    slice: {rank: 1}\n"),
                  "subscriber.upstream.slice.rank: 1 is given without slice.ranks");
  EXPECT_CONTAINS(SubscriberError(head + "    slice: {ranks: 1025}\n"),
                  "subscriber.upstream.slice.ranks: 1025 is out of range");
  EXPECT_CONTAINS(SubscriberError(head + "    slice: {ranks: 2}\n  serve_peers: true\n"),
                  "subscriber.upstream.slice: cannot be combined with serve_peers");
  EXPECT_CONTAINS(SubscriberError("subscriber:\n  listen: \"127.0.0.1:0\"\n  upstream:\n"
                                  "    shards:\n    - addresses: [\"127.0.0.1:7400\"]\n"
                                  "    shard_set: policy\n    slice: {ranks: 2}\n"),
                  "subscriber.upstream.slice: is not supported with upstream.shards");
}

// ---- files -----------------------------------------------------------------------------------

TEST(ConfigTest, CutRules) {
  const std::string& pub = kPubListen;
  const std::string ok = pub +
                         "  cut:\n    parts: 4\n    rows: [\"layers.*.q_proj.weight\", "
                         "\"lm_head.weight\"]\n    columns: [\"layers.*.o_proj.weight\"]\n";
  REFIT_ASSERT_OK_AND_ASSIGN(auto p, LoadPublisherConfigFromString(ok, "pub.yaml"));
  EXPECT_EQ(p.cut().parts(), 4u);
  EXPECT_EQ(p.cut().rows_size(), 2);
  EXPECT_EQ(p.cut().columns(0), "layers.*.o_proj.weight");
  // The effective config written out loads back the same.
  auto p2 = LoadPublisherConfigFromString(ConfigToYaml(p));
  ASSERT_THAT(p2, IsOk()) << ConfigToYaml(p);
  EXPECT_TRUE(MessageDifferencer::Equals(p, *p2));
  EXPECT_EQ(PublisherError(pub + "  cut: {parts: 2, columns: [o]}\n"), "");
  EXPECT_EQ(PublisherError(pub + "  cut: {parts: 0}\n"), "");

  EXPECT_CONTAINS(PublisherError(pub + "  cut: {parts: 2}\n"),
                  "publisher.cut.parts: is 2 but cut.rows and cut.columns are empty");
  EXPECT_CONTAINS(PublisherError(pub + "  cut: {rows: [w]}\n"),
                  "publisher.cut.parts: is 0 (no cuts) but cut.rows or cut.columns lists "
                  "patterns");
  EXPECT_CONTAINS(PublisherError(pub + "  cut: {parts: 2, rows: [w, \"\"]}\n"),
                  "publisher.cut.rows[1]: is empty");
  EXPECT_CONTAINS(PublisherError(pub + "  cut: {parts: 2, columns: [\"a\\tb\"]}\n"),
                  "publisher.cut.columns[0]: contains a control character");
  EXPECT_CONTAINS(PublisherError(pub + "  cut: {parts: 2, columns: [o, x, o]}\n"),
                  "publisher.cut.columns[2]: \"o\" is listed twice (also at index 0)");
  EXPECT_CONTAINS(PublisherError(pub + "  cut: {parts: 2, rows: [w], columns: [w]}\n"),
                  "publisher.cut.columns[0]: \"w\" is also in cut.rows");
  EXPECT_CONTAINS(PublisherError(pub + "  cut: {parts: 1025, rows: [w]}\n"),
                  "publisher.cut.parts: 1025 is out of range");
  EXPECT_CONTAINS(
      PublisherError(pub + "  shard: {set: policy, count: 2}\n  cut: {parts: 2, rows: [w]}\n"),
      "publisher.cut.parts: is set together with publisher.shard.count");
}

TEST(ConfigTest, LoadsFromFiles) {
  const std::string path = WriteFile("pub.yaml", kFullPublisher);
  REFIT_ASSERT_OK_AND_ASSIGN(auto p, LoadPublisherConfig(path));
  EXPECT_EQ(p.name(), "trainer-a");
  const std::string bad = WriteFile("bad.yaml", "publisher:\n  listen: \"0.0.0.0:1\"\n");
  auto b = LoadPublisherConfig(bad);
  ASSERT_THAT(b, Not(IsOk()));
  EXPECT_CONTAINS(b.status().message(), bad + ":2:11: publisher.listen:");
  auto f = LoadConfigFile(path);
  EXPECT_THAT(f, IsOk());
  unlink(path.c_str());
  unlink(bad.c_str());
}

TEST(ConfigTest, MissingAndUnreadableFiles) {
  auto missing = LoadPublisherConfig("/nonexistent/dir/publisher.yaml");
  ASSERT_THAT(
      missing,
      StatusIs(absl::StatusCode::kNotFound,
               HasSubstr("cannot read config \"/nonexistent/dir/publisher.yaml\": No such file or "
                         "directory")));
  auto dir = LoadSubscriberConfig(::testing::TempDir());
  ASSERT_THAT(dir, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a regular file")));
  auto empty = LoadPublisherConfig("");
  ASSERT_THAT(empty, Not(IsOk()));
  EXPECT_CONTAINS(empty.status().message(), "empty path");
  if (geteuid() != 0) {  // root reads anything
    const std::string locked = WriteFile("locked.yaml", kFullPublisher);
    ASSERT_EQ(chmod(locked.c_str(), 0), 0);
    auto denied = LoadPublisherConfig(locked);
    ASSERT_THAT(denied, StatusIs(absl::StatusCode::kPermissionDenied));
    unlink(locked.c_str());
  }
}

// A self-signed certificate and its key made with the openssl CLI: {cert, key}, or {} without it.
std::pair<std::string, std::string> SelfSigned(const std::string& stem) {
  const std::string cert = WriteFile(stem + ".crt", "");
  const std::string key = WriteFile(stem + ".key", "");
  const std::string cmd = "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 "
                          "-nodes -days 2 -subj /CN=" + stem + " -keyout '" + key + "' -out '" +
                          cert + "' >/dev/null 2>&1";
  if (std::system(cmd.c_str()) != 0) return {};
  return {cert, key};
}

TEST(ConfigTest, FileAccessRules) {
  const std::string pub = "publisher:\n  listen: \"127.0.0.1:0\"\n";
  auto files = [&](const std::string& block, const std::string& extra = "") {
    return PublisherError(pub + extra + "  files:\n" + block);
  };
  EXPECT_EQ(files("    publish_dirs: [/srv/publish]\n    export_dir: /srv/export\n"), "");
  EXPECT_CONTAINS(files("    publish_dirs: [relative]\n"), "publisher.files.publish_dirs[0]");
  EXPECT_CONTAINS(files("    publish_dirs: [/srv/../etc]\n"), "\"..\" component");
  EXPECT_CONTAINS(files("    publish_dirs: [/]\n"), "every file");
  EXPECT_CONTAINS(files("    export_dir: tmp\n"), "publisher.files.export_dir");
  EXPECT_CONTAINS(files("    export_mode: \"0700\"\n"), "not an octal file mode up to 0666");
  EXPECT_CONTAINS(files("    export_mode: \"rw\"\n"), "publisher.files.export_mode");
  EXPECT_EQ(files("    export_mode: \"0644\"\n"), "");
  const std::string persist = "  baseline:\n    persist_dir: /srv/state/baseline\n";
  EXPECT_CONTAINS(files("    export_dir: /srv/state\n", persist), "persist_dir");
  EXPECT_CONTAINS(files("    export_dir: /srv/state/baseline/x\n", persist), "persist_dir");
  EXPECT_EQ(files("    export_dir: /srv/state/export\n", persist), "");
  REFIT_ASSERT_OK_AND_ASSIGN(auto c, LoadPublisherConfigFromString(pub, "pub.yaml"));
  EXPECT_EQ(c.files().export_mode(), "0600");
  EXPECT_EQ(c.files().export_dir(), "");
  EXPECT_EQ(c.files().publish_dirs_size(), 0);
  EXPECT_CONTAINS(SubscriberError("subscriber:\n  upstream: {addresses: [\"127.0.0.1:1\"]}\n"
                                  "  listen: \"127.0.0.1:0\"\n  files: {publish_dirs: [/x]}\n"),
                  "subscriber.files.publish_dirs[0]");
}

// A FIFO as --config (or a PEM file) is an error at once, not an open() that blocks forever.
TEST(ConfigTest, AFifoIsRefusedWithoutBlocking) {
  const std::string fifo =
      ::testing::TempDir() + "refit_config_test_" + std::to_string(getpid()) + "_fifo.yaml";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  auto c = LoadPublisherConfig(fifo);
  ASSERT_THAT(c, StatusIs(absl::StatusCode::kInvalidArgument,
                          AllOf(HasSubstr("is a FIFO"), HasSubstr(fifo))));
  unlink(fifo.c_str());
}

TEST(ConfigTest, CheckConfigFiles) {
  const auto [cert, key] = SelfSigned("c");
  if (cert.empty()) GTEST_SKIP() << "openssl CLI unavailable";
  const std::string yaml = "publisher:\n  listen: \"0.0.0.0:0\"\n  tls: {cert: " + cert +
                           ", key: " + key + ", ca: " + cert + "}\n";
  REFIT_ASSERT_OK_AND_ASSIGN(auto p, LoadPublisherConfigFromString(yaml));
  EXPECT_THAT(CheckConfigFiles(p), IsOk());

  v1::PublisherConfig swapped = p;
  swapped.mutable_tls()->set_cert(key);
  swapped.mutable_tls()->set_key(cert);
  absl::Status s = CheckConfigFiles(swapped);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_CONTAINS(s.message(), "publisher.tls.cert \"" + key + "\" is not a PEM certificate");

  // A key that parses but belongs to another certificate.
  const auto [other_cert, other_key] = SelfSigned("other");
  v1::PublisherConfig mismatch = p;
  mismatch.mutable_tls()->set_key(other_key);
  s = CheckConfigFiles(mismatch);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "publisher.tls.key \"" + other_key +
                             "\" does not match the certificate publisher.tls.cert \"" + cert +
                             "\"");
  unlink(other_cert.c_str());
  unlink(other_key.c_str());

  v1::PublisherConfig gone = p;
  gone.mutable_tls()->set_ca("/nonexistent/ca.crt");
  s = CheckConfigFiles(gone);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_CONTAINS(s.message(), "cannot read publisher.tls.ca \"/nonexistent/ca.crt\"");

  auto sub = LoadSubscriberConfigFromString(
      "subscriber:\n  listen: \"127.0.0.1:0\"\n  upstream:\n    addresses: [\"10.0.0.1:1\"]\n"
      "    tls: {cert: " +
      cert + ", key: /nonexistent/k.key, ca: " + cert + "}\n");
  ASSERT_THAT(sub, IsOk());
  s = CheckConfigFiles(*sub);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_CONTAINS(s.message(), "subscriber.upstream.tls.key");
  // No TLS: nothing to check.
  REFIT_ASSERT_OK_AND_ASSIGN(auto plain, LoadSubscriberConfigFromString(Sub("")));
  EXPECT_THAT(CheckConfigFiles(plain), IsOk());
  unlink(cert.c_str());
  unlink(key.c_str());
}

TEST(ConfigTest, ValidateDirectlyWithoutSourceMap) {
  v1::PublisherConfig p;
  p.set_listen("10.0.0.1:7000");
  ASSERT_THAT(ApplyDefaults(&p), IsOk());
  absl::Status s = ValidatePublisherConfig(p);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message().substr(0, 17), "publisher.listen:");
  p.mutable_tls()->set_insecure(true);
  EXPECT_THAT(ValidatePublisherConfig(p), IsOk());
}

TEST(ConfigTest, PatchLogBoundsAreRangeChecked) {
  const std::string head = "publisher:\n  listen: \"127.0.0.1:0\"\n  baseline:\n";
  auto ok = LoadPublisherConfigFromString(head + "    compact_log_versions: 3\n"
                                          "    compact_log_bytes: 1048576\n"
                                          "    max_queued_versions: 2\n"
                                          "    max_queued_bytes: 1000\n");
  ASSERT_THAT(ok, IsOk());
  EXPECT_EQ(ok->baseline().compact_log_versions(), 3u);
  EXPECT_EQ(ok->baseline().max_queued_bytes(), 1000u);
  EXPECT_CONTAINS(PublisherError(head + "    compact_log_versions: 0\n"),
                  "publisher.baseline.compact_log_versions: 0 is out of range");
  EXPECT_CONTAINS(PublisherError(head + "    compact_log_bytes: 100\n"),
                  "publisher.baseline.compact_log_bytes: 100 is out of range");
  EXPECT_CONTAINS(PublisherError(head + "    max_queued_versions: 5000\n"),
                  "publisher.baseline.max_queued_versions: 5000 is out of range");
}

}  // namespace
// Found by config_fuzzer (the same class as a control character in a key): a value the rules
// quote in their error, here an address with a line break, keeps the error one line.
TEST(ConfigTest, ControlCharactersInValuesAreEscapedInErrors) {
  const std::string e = PublisherError("publisher:\n  listen: \"0.0.0.0:7400\\nx\"\n");
  EXPECT_CONTAINS(e, "pub.yaml:2:11: publisher.listen: \"0.0.0.0:7400\\nx\"");
}


TEST(ConfigTest, NameIsPrintableBoundedUtf8) {
  EXPECT_EQ(PublisherError(kPubListen + "  name: \"pub-\u00e9\u4e2d\"\n"), "");
  EXPECT_CONTAINS(PublisherError(kPubListen + "  name: \"a\\x1b[31mb\"\n"),
                  "pub.yaml:3:9: publisher.name: contains a control character (byte 1)");
  EXPECT_CONTAINS(PublisherError(kPubListen + "  name: \"a\\nb\"\n"),
                  "publisher.name: contains a control character");
  EXPECT_CONTAINS(PublisherError(kPubListen + "  name: \"a\\u0085\"\n"),
                  "publisher.name: contains a control character");
  EXPECT_CONTAINS(PublisherError(kPubListen + "  name: " + std::string(129, 'n') + "\n"),
                  "publisher.name: is 129 bytes; the limit is 128");
  EXPECT_EQ(PublisherError(kPubListen + "  name: " + std::string(128, 'n') + "\n"), "");
  // Invalid UTF-8 (a lone continuation byte; an overlong '/').
  EXPECT_CONTAINS(PublisherError(kPubListen + "  name: \"a\x80\"\n"),
                  "publisher.name: is not valid UTF-8 (byte 1)");
  EXPECT_CONTAINS(PublisherError(kPubListen + "  name: \"\xc0\xaf\"\n"),
                  "publisher.name: is not valid UTF-8 (byte 0)");
  EXPECT_CONTAINS(SubscriberError(Sub("  name: \"x\\ty\"\n")),
                  "subscriber.name: contains a control character");
}

TEST(ConfigTest, RelativeUnixSocketPathsAreRefused) {
  EXPECT_CONTAINS(PublisherError("publisher:\n  listen: \"unix:run/p.sock\"\n"),
                  "publisher.listen: \"unix:run/p.sock\": unix socket path \"run/p.sock\" is "
                  "relative: give an absolute path");
  EXPECT_CONTAINS(PublisherError(kPubListen + "  control_listen: \"unix:c.sock\"\n"),
                  "publisher.control_listen");
  EXPECT_CONTAINS(PublisherError(kPubListen + "  local_socket: \"t.sock\"\n"),
                  "publisher.local_socket: \"t.sock\" is relative: give an absolute path");
  EXPECT_CONTAINS(SubscriberError("subscriber:\n  upstream:\n    addresses: [\"unix:p.sock\"]\n"
                                  "  listen: \"127.0.0.1:0\"\n"),
                  "subscriber.upstream.addresses[0]: \"unix:p.sock\": unix socket path \"p.sock\" "
                  "is relative");
}

TEST(ConfigTest, AbstractUnixSocketsNeedTlsOrInsecure) {
  EXPECT_CONTAINS(PublisherError("publisher:\n  listen: \"unix-abstract:refit\"\n"),
                  "publisher.listen: \"unix-abstract:refit\" is not a loopback address (abstract "
                  "unix sockets have no file permissions: anyone in the network namespace can "
                  "connect), so publisher.tls needs cert, key and ca (mTLS), or set "
                  "publisher.tls.insecure: true explicitly");
  EXPECT_EQ(PublisherError("publisher:\n  listen: \"unix-abstract:refit\"\n"
                           "  tls: {insecure: true}\n"),
            "");
  EXPECT_CONTAINS(SubscriberError("subscriber:\n  upstream:\n    addresses: "
                                  "[\"unix-abstract:pub\"]\n  listen: \"127.0.0.1:0\"\n"),
                  "(abstract unix sockets have no file permissions");
}

}  // namespace refit::config
