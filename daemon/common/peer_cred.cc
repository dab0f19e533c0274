#include "daemon/common/peer_cred.h"

#include <grp.h>
#include <pwd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/server_context.h"

namespace refit {
namespace {

struct FdPeers {
  absl::Mutex mu;
  absl::flat_hash_map<std::string, PeerCred> by_peer ABSL_GUARDED_BY(mu);
};

FdPeers& Registry() {
  static FdPeers* const registry = new FdPeers();  // never destroyed: used until exit
  return *registry;
}

bool Contains(const std::vector<uint32_t>& v, uint32_t x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

// The groups the user database lists for `uid` (empty when it does not know the uid).
std::vector<uint32_t> UserGroups(uint32_t uid, uint32_t primary_gid) {
  std::vector<char> buf(16384);
  passwd pw{};
  passwd* found = nullptr;
  if (getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) != 0 || found == nullptr) return {};
  int count = 64;
  std::vector<gid_t> groups(static_cast<size_t>(count));
  if (getgrouplist(pw.pw_name, primary_gid, groups.data(), &count) < 0) {
    groups.resize(static_cast<size_t>(count));
    if (getgrouplist(pw.pw_name, primary_gid, groups.data(), &count) < 0) return {};
  }
  groups.resize(static_cast<size_t>(count));
  return std::vector<uint32_t>(groups.begin(), groups.end());
}

}  // namespace

std::string PeerCred::Describe() const {
  return absl::StrCat("uid ", uid, " gid ", gid, " pid ", pid);
}

absl::StatusOr<PeerCred> SocketPeerCred(int fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return absl::InternalError(absl::StrCat("SO_PEERCRED: ", std::strerror(errno)));
  }
  return PeerCred{.pid = cred.pid, .uid = cred.uid, .gid = cred.gid};
}

void RecordFdPeer(int fd, const PeerCred& cred) {
  FdPeers& r = Registry();
  absl::MutexLock lock(&r.mu);
  r.by_peer[absl::StrCat("fd:", fd)] = cred;
}

std::optional<PeerCred> PeerCredOfPeer(std::string_view peer) {
  FdPeers& r = Registry();
  absl::MutexLock lock(&r.mu);
  const auto it = r.by_peer.find(std::string(peer));
  if (it == r.by_peer.end()) return std::nullopt;
  return it->second;
}

std::optional<PeerCred> PeerCredOf(const grpc::ServerContext& context) {
  return PeerCredOfPeer(context.peer());
}

bool PeerListed(const PeerCred& cred, const std::vector<uint32_t>& uids,
                const std::vector<uint32_t>& gids) {
  if (Contains(uids, cred.uid) || Contains(gids, cred.gid)) return true;
  if (gids.empty()) return false;
  for (const uint32_t g : UserGroups(cred.uid, cred.gid)) {
    if (Contains(gids, g)) return true;
  }
  return false;
}

bool PeerMatches(const PeerCred& cred, const std::vector<uint32_t>& uids,
                 const std::vector<uint32_t>& gids) {
  if (cred.uid == 0 || cred.uid == static_cast<uint32_t>(geteuid())) return true;
  return PeerListed(cred, uids, gids);
}

}  // namespace refit
