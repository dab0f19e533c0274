// gRPC addresses in configs and on the command line: parsing, loopback detection.
//
// Accepted forms (docs in proto/refit/v1/config.proto):
//   host:port, [ipv6]:port              TCP; host = IPv4 / IPv6 literal or a DNS name
//   unix:/abs/path, unix:///abs/path    unix domain socket (absolute path, at most 107 bytes;
//                                       relative paths are refused)
//   unix-abstract:name                  Linux abstract unix socket
// and, for connections only, gRPC's scheme forms dns:///host:port, dns:host:port,
// ipv4:a.b.c.d:port, ipv6:[addr]:port. Listen addresses may use port 0 (chosen by the OS).
//
// Loopback: 127.0.0.0/8, ::1 (also ::ffff:127.x.y.z), "localhost" (any case, optional trailing
// dot), and unix sockets with a path. Everything else, including 0.0.0.0 / [::] (all interfaces),
// every other host name and abstract unix sockets (no file permissions: anyone in the network
// namespace can connect), is non-loopback: names are not resolved, because what they resolve to
// can change after the config was checked.
#ifndef REFIT_DAEMON_CONFIG_ADDRESS_H_
#define REFIT_DAEMON_CONFIG_ADDRESS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace refit::config {

enum class AddressUse { kListen, kConnect };
enum class AddressKind { kTcp, kUnix, kUnixAbstract };

struct Address {
  AddressKind kind = AddressKind::kTcp;
  // kTcp: host without brackets ("10.0.0.1", "::1", "pub.example.com") and port.
  std::string host;
  uint16_t port = 0;
  // kUnix: the socket's filesystem path; kUnixAbstract: the abstract name.
  std::string path;
  bool loopback = false;
  // The string to hand to gRPC (ServerBuilder::AddListeningPort, grpc::CreateChannel): the input
  // with "unix:///p" normalised to "unix:/p"; scheme forms (dns:, ipv4:, ipv6:) unchanged.
  std::string grpc_target;
};

// Parses `text`; errors (InvalidArgument) say what is wrong, without a field name (callers
// prefix it), e.g. `port 70000 is out of range (1..65535)`.
absl::StatusOr<Address> ParseAddress(const std::string& text, AddressUse use);

// Why a listener on `address` may fail to bind, from what the filesystem says: for a unix socket
// whose directory is missing, not a directory or not writable, e.g. "directory /x does not
// exist"; "" when nothing is visibly wrong (TCP: port in use, address not on this host).
std::string UnixSocketDirectoryProblem(const Address& address);

// Loopback test for a bare host (no port, no brackets): see above.
bool IsLoopbackHost(const std::string& host);

// Longest unix socket path (sockaddr_un.sun_path minus the terminating NUL).
inline constexpr size_t kMaxUnixPathBytes = 107;

}  // namespace refit::config

#endif  // REFIT_DAEMON_CONFIG_ADDRESS_H_
