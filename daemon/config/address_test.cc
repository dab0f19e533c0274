#include "daemon/config/address.h"

#include <string>

#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"

namespace refit::config {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::Not;

struct Case {
  const char* text;
  bool loopback;
};

TEST(AddressTest, LoopbackAddresses) {
  for (const Case& c :
       {Case{"127.0.0.1:700", true}, Case{"127.1.2.3:7000", true}, Case{"127.255.255.255:1", true},
        Case{"[::1]:7000", true}, Case{"[::ffff:127.0.0.1]:7000", true},
        Case{"localhost:700", true}, Case{"LocalHost:700", true}, Case{"localhost.:700", true},
        Case{"unix:/run/refitd.sock", true}, Case{"unix:///run/refitd.sock", true}}) {
    for (AddressUse use : {AddressUse::kListen, AddressUse::kConnect}) {
      auto a = ParseAddress(c.text, use);
      ASSERT_THAT(a, IsOk()) << c.text << ": " << a.status();
      EXPECT_EQ(a->loopback, c.loopback) << c.text;
    }
  }
}

TEST(AddressTest, NonLoopbackAddresses) {
  for (const char* text :
       {"0.0.0.0:7000", "[::]:7000", "10.0.0.7:7000", "128.0.0.1:7000", "126.255.255.255:7000",
        "[2001:db8::1]:7000", "[::ffff:10.0.0.1]:7000", "pub.example.com:7000",
        "localhost.example.com:7000", "mylocalhost:700", "127.0.0.1.nip.io:700"}) {
    auto a = ParseAddress(text, AddressUse::kListen);
    ASSERT_THAT(a, IsOk()) << text << ": " << a.status();
    EXPECT_FALSE(a->loopback) << text;
    EXPECT_EQ(a->kind, AddressKind::kTcp);
  }
}

TEST(AddressTest, ConnectSchemes) {
  REFIT_ASSERT_OK_AND_ASSIGN(auto dns,
                             ParseAddress("dns:///pub.example.com:7000", AddressUse::kConnect));
  EXPECT_EQ(dns.host, "pub.example.com");
  EXPECT_EQ(dns.port, 7000);
  EXPECT_EQ(dns.grpc_target, "dns:///pub.example.com:7000");
  EXPECT_FALSE(dns.loopback);

  REFIT_ASSERT_OK_AND_ASSIGN(auto dns_local,
                             ParseAddress("dns:localhost:700", AddressUse::kConnect));
  EXPECT_TRUE(dns_local.loopback);

  REFIT_ASSERT_OK_AND_ASSIGN(auto v4, ParseAddress("ipv4:127.0.0.1:9", AddressUse::kConnect));
  EXPECT_TRUE(v4.loopback);
  EXPECT_EQ(v4.port, 9);

  REFIT_ASSERT_OK_AND_ASSIGN(auto v6, ParseAddress("ipv6:[::1]:9", AddressUse::kConnect));
  EXPECT_TRUE(v6.loopback);
  EXPECT_EQ(v6.host, "::1");

  // Scheme forms are for connections only.
  EXPECT_THAT(ParseAddress("dns:///pub:7000", AddressUse::kListen), Not(IsOk()));
}

TEST(AddressTest, UnixForms) {
  REFIT_ASSERT_OK_AND_ASSIGN(auto a, ParseAddress("unix:///run/x.sock", AddressUse::kListen));
  EXPECT_EQ(a.kind, AddressKind::kUnix);
  EXPECT_EQ(a.path, "/run/x.sock");
  EXPECT_EQ(a.grpc_target, "unix:/run/x.sock");
  REFIT_ASSERT_OK_AND_ASSIGN(auto b, ParseAddress("unix-abstract:refit", AddressUse::kConnect));
  EXPECT_EQ(b.kind, AddressKind::kUnixAbstract);
  EXPECT_EQ(b.grpc_target, "unix-abstract:refit");
  // Longest accepted path, then one byte more.
  EXPECT_THAT(ParseAddress("unix:/" + std::string(kMaxUnixPathBytes - 1, 'a'), AddressUse::kListen),
              IsOk());
  auto too_long = ParseAddress("unix:/" + std::string(kMaxUnixPathBytes, 'a'), AddressUse::kListen);
  ASSERT_THAT(too_long, Not(IsOk()));
  EXPECT_NE(too_long.status().message().find("the limit is 107"), std::string::npos);
}

TEST(AddressTest, Ports) {
  EXPECT_THAT(ParseAddress("127.0.0.1:0", AddressUse::kListen), IsOk());
  EXPECT_THAT(ParseAddress("127.0.0.2:65535", AddressUse::kConnect), IsOk());
  auto zero = ParseAddress("127.0.0.1:0", AddressUse::kConnect);
  ASSERT_THAT(zero, Not(IsOk()));
  EXPECT_NE(zero.status().message().find("port 0 is out of range (1..65535"), std::string::npos)
      << zero.status();
  auto big = ParseAddress("127.0.0.2:65536", AddressUse::kListen);
  ASSERT_THAT(big, Not(IsOk()));
  EXPECT_NE(big.status().message().find("65536"), std::string::npos);
}

TEST(AddressTest, Errors) {
  struct Bad {
    const char* text;
    const char* message;
  };
  for (const Bad& b : {Bad{"", "empty address"},
                       Bad{"127.0.0.1", "missing ':port'"},
                       Bad{"127.0.0.1:", "missing port"},
                       Bad{"127.0.0.1:http", "is not a number"},
                       Bad{"127.0.0.2:123456", "is not a number"},
                       Bad{":7000", "missing host"},
                       Bad{"::1:7000", "needs brackets"},
                       Bad{"[::1:7000", "missing ']'"},
                       Bad{"[::1]7000", "expected ':port'"},
                       Bad{"[10.0.0.1]:7000", "is not an IPv6 address"},
                       Bad{"bad_host!:7000", "is not an IP address or host name"},
                       Bad{"-bad.example:7000", "is not an IP address or host name"},
                       Bad{"a b:7000", "whitespace"},
                       Bad{"unix:", "missing socket path"},
                       Bad{"unix://host/x.sock", "absolute path"},
                       Bad{"unix-abstract:", "missing name"},
                       Bad{"unix:rel.sock", "unix socket path \"rel.sock\" is relative"},
                       Bad{"unix:./x.sock", "is relative: give an absolute path"},
                       Bad{"ipv4:pub.example:7000", "is not an IPv4 address"},
                       Bad{"ipv4:127.0.0.1:1,127.0.0.2:1", "no comma"},
                       Bad{"dns://8.8.8.8/pub:7000", "authority"},
                       Bad{"http://pub:7000", "unexpected '/'"}}) {
    auto a = ParseAddress(b.text, AddressUse::kConnect);
    ASSERT_THAT(a, StatusIs(absl::StatusCode::kInvalidArgument)) << b.text;
    EXPECT_NE(a.status().message().find(b.message), std::string::npos)
        << b.text << " -> " << a.status();
    EXPECT_EQ(a.status().message().find('\n'), std::string::npos);
  }
}

// Abstract sockets have no file permissions: anyone in the network namespace can connect.
TEST(AddressTest, AbstractUnixSocketsAreNotLoopback) {
  for (AddressUse use : {AddressUse::kListen, AddressUse::kConnect}) {
    REFIT_ASSERT_OK_AND_ASSIGN(auto a, ParseAddress("unix-abstract:refitd", use));
    EXPECT_EQ(a.kind, AddressKind::kUnixAbstract);
    EXPECT_FALSE(a.loopback);
  }
}

TEST(AddressTest, UnixSocketDirectoryProblem) {
  REFIT_ASSERT_OK_AND_ASSIGN(
      auto missing, ParseAddress("unix:/nonexistent-refit-dir/x.sock", AddressUse::kListen));
  EXPECT_EQ(UnixSocketDirectoryProblem(missing), "directory /nonexistent-refit-dir does not exist");
  REFIT_ASSERT_OK_AND_ASSIGN(auto file,
                             ParseAddress("unix:/proc/self/status/x.sock", AddressUse::kListen));
  EXPECT_EQ(UnixSocketDirectoryProblem(file), "/proc/self/status is not a directory");
  REFIT_ASSERT_OK_AND_ASSIGN(auto ok, ParseAddress("unix:/tmp/x.sock", AddressUse::kListen));
  EXPECT_EQ(UnixSocketDirectoryProblem(ok), "");
  REFIT_ASSERT_OK_AND_ASSIGN(auto tcp, ParseAddress("127.0.0.1:0", AddressUse::kListen));
  EXPECT_EQ(UnixSocketDirectoryProblem(tcp), "");
}

TEST(AddressTest, IsLoopbackHost) {
  EXPECT_TRUE(IsLoopbackHost("127.0.0.1"));
  EXPECT_TRUE(IsLoopbackHost("127.9.9.9"));
  EXPECT_TRUE(IsLoopbackHost("::1"));
  EXPECT_TRUE(IsLoopbackHost("localhost"));
  EXPECT_FALSE(IsLoopbackHost("0.0.0.0"));
  EXPECT_FALSE(IsLoopbackHost("::"));
  EXPECT_FALSE(IsLoopbackHost("example.com"));
  EXPECT_FALSE(IsLoopbackHost(""));
}

}  // namespace
}  // namespace refit::config
