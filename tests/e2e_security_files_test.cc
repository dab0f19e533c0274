// Hostile files and paths through Control, against real daemons: Control Publish reads only
// beneath publisher.files.publish_dirs, Export writes only beneath files.export_dir (never over a
// FIFO or symlink, never into the persist_dir, mode 0600), a FIFO never wedges the publish worker
// or a daemon reading its --config, and no error quotes a file's bytes. The Control client runs
// unprivileged where it can (CI runs as root): the daemon's rights must not leak to it.
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/common/status_matchers.h"
#include "gtest/gtest.h"
#include "tests/harness/e2e.h"

namespace refit::e2e {
namespace {

// refitctl as user nobody when running as root (setpriv), else as ourselves.
CommandResult RefitctlUnprivileged(const std::vector<std::string>& args,
                                   absl::Duration timeout = absl::Seconds(30)) {
  std::vector<std::string> argv = {RefitctlBin()};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunCommand(AsUnprivilegedUser(std::move(argv)), timeout);
}

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

mode_t LstatMode(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0 ? st.st_mode : 0;
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class E2ESecurityFiles : public E2ETest {
 protected:
  Model TinyModel(uint64_t seed) { return RandomModel(seed, {{"w", 256}, {"b", 16}}); }

  // refitctl export on `d` to `path`, as an unprivileged client.
  CommandResult ExportTo(const DaemonProcess& d, const std::string& path) {
    return RefitctlUnprivileged({"--target", d.control_target(), "export", "--safetensors", path});
  }
};

TEST_F(E2ESecurityFiles, PublishReadsOnlyBeneathPublishDirsAndQuotesNoFileBytes) {
  const std::string publish_dir = Path("publish");
  std::filesystem::create_directories(publish_dir);
  PublisherSpec ps;
  ps.publish_dirs = std::vector<std::string>{publish_dir};
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  const std::string target = pub.control_target();

  // A model outside publish_dirs, in a root-only directory (as /etc/shadow would be).
  std::filesystem::create_directories(Path("private"));
  ::chmod(Path("private").c_str(), 0700);
  const Model m = TinyModel(1);
  E2E_ASSERT_OK(WriteModel(Path("private/model.safetensors"), m));
  CommandResult r = RefitctlUnprivileged(
      {"--target", target, "publish", "--safetensors", Path("private/model.safetensors")});
  EXPECT_NE(r.exit_code, 0) << r.Describe();
  EXPECT_TRUE(Contains(r.err, Path("private/model.safetensors"))) << r.Describe();
  EXPECT_TRUE(Contains(r.err, "publisher.files.publish_dirs")) << r.Describe();

  // Escapes: "..", and a symlink inside publish_dirs pointing out of it.
  r = RefitctlUnprivileged({"--target", target, "publish", "--safetensors",
                            publish_dir + "/../private/model.safetensors"});
  EXPECT_NE(r.exit_code, 0) << r.Describe();
  ASSERT_EQ(::symlink(Path("private/model.safetensors").c_str(),
                      (publish_dir + "/link.safetensors").c_str()),
            0);
  r = RefitctlUnprivileged(
      {"--target", target, "publish", "--safetensors", publish_dir + "/link.safetensors"});
  EXPECT_NE(r.exit_code, 0) << r.Describe();
  EXPECT_TRUE(Contains(r.err, "link.safetensors")) << r.Describe();

  // A file that is not safetensors: its first 8 bytes (the "header length") never show.
  const std::string secret = "hunter2-password-hash-0123456789abcdef";
  std::ofstream(publish_dir + "/secret.safetensors") << secret;
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(secret[i]);
  r = RefitctlUnprivileged(
      {"--target", target, "publish", "--safetensors", publish_dir + "/secret.safetensors"});
  EXPECT_NE(r.exit_code, 0) << r.Describe();
  EXPECT_FALSE(Contains(r.err, absl::StrCat(n))) << r.Describe();
  EXPECT_FALSE(Contains(r.err, "hunter2")) << r.Describe();
  EXPECT_FALSE(Contains(pub.LogTail(200), absl::StrCat(n)));

  // Nothing was published; a file inside publish_dirs is.
  E2E_ASSERT_OK(WriteModel(publish_dir + "/model.safetensors", m));
  r = RefitctlUnprivileged(
      {"--target", target, "publish", "--safetensors", publish_dir + "/model.safetensors"});
  EXPECT_EQ(r.exit_code, 0) << r.Describe();
  E2E_EXPECT_OK(WaitVersion(pub, 1));
}

TEST_F(E2ESecurityFiles, NoPublishDirsMeansControlFilePublishIsRefused) {
  PublisherSpec ps;
  ps.publish_dirs.emplace();  // present and empty
  DaemonProcess& pub = NewPublisher(ps);
  E2E_ASSERT_OK(pub.Start());
  REFIT_ASSERT_OK_AND_ASSIGN(std::string file, WriteModelFile(TinyModel(2), "m"));
  CommandResult r =
      RefitctlUnprivileged({"--target", pub.control_target(), "publish", "--safetensors", file});
  EXPECT_NE(r.exit_code, 0) << r.Describe();
  EXPECT_TRUE(Contains(r.err, "publisher.files.publish_dirs is empty")) << r.Describe();
}

TEST_F(E2ESecurityFiles, PublishOfAFifoFailsPromptlyAndTheNextPublishWorks) {
  DaemonProcess& pub = NewPublisher(PublisherSpec());
  E2E_ASSERT_OK(pub.Start());
  const std::string fifo = Path("model.fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0666), 0);
  // No writer ever opens the FIFO: a blocking open() in the daemon would never return.
  CommandResult r = RefitctlUnprivileged(
      {"--target", pub.control_target(), "--timeout", "20", "publish", "--safetensors", fifo});
  EXPECT_FALSE(r.timed_out) << r.Describe();
  EXPECT_NE(r.exit_code, 0) << r.Describe();
  EXPECT_TRUE(Contains(r.err, "is a FIFO")) << r.Describe();
  E2E_ASSERT_OK(Publish(pub, TinyModel(3), 1));
  E2E_EXPECT_OK(WaitVersion(pub, 1));
}

TEST_F(E2ESecurityFiles, ExportWritesOnlyBeneathExportDirNeverOverAFifoOrSymlinkMode0600) {
  PublisherSpec ps;
  ps.persist_dir = Path("baseline");
  REFIT_ASSERT_OK_AND_ASSIGN(PubSub ps_pair, StartPubSub("sub", ps));
  const Model m = TinyModel(4);
  E2E_ASSERT_OK(Publish(*ps_pair.pub, m, 1));
  E2E_ASSERT_OK(WaitVersion(*ps_pair.sub, 1));
  const std::string export_dir = DefaultExportDir(dir());
  const std::string victim = Path("victim.txt");
  std::ofstream(victim) << "keep";
  ::chmod(victim.c_str(), 0644);
  const std::string fifo = export_dir + "/fifo.safetensors";
  const std::string link = export_dir + "/link.safetensors";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0666), 0);
  ASSERT_EQ(::symlink(victim.c_str(), link.c_str()), 0);

  for (DaemonProcess* d : {ps_pair.pub, ps_pair.sub}) {
    SCOPED_TRACE(d->name());
    const std::string field = absl::StrCat(d->role(), ".files.export_dir");
    // Outside export_dir: over a root-owned file, and a new file in a root-only directory.
    CommandResult r = ExportTo(*d, victim);
    EXPECT_NE(r.exit_code, 0) << r.Describe();
    EXPECT_TRUE(Contains(r.err, field)) << r.Describe();
    std::filesystem::create_directories(Path("private"));
    ::chmod(Path("private").c_str(), 0700);
    r = ExportTo(*d, Path("private/new.safetensors"));
    EXPECT_NE(r.exit_code, 0) << r.Describe();
    EXPECT_FALSE(std::filesystem::exists(Path("private/new.safetensors")));
    // Over a FIFO and a symlink: refused, both still there, the symlink's target untouched.
    r = ExportTo(*d, fifo);
    EXPECT_NE(r.exit_code, 0) << r.Describe();
    EXPECT_TRUE(Contains(r.err, "is a FIFO")) << r.Describe();
    EXPECT_TRUE(S_ISFIFO(LstatMode(fifo)));
    r = ExportTo(*d, link);
    EXPECT_NE(r.exit_code, 0) << r.Describe();
    EXPECT_TRUE(Contains(r.err, "is a symbolic link")) << r.Describe();
    EXPECT_TRUE(S_ISLNK(LstatMode(link)));
    EXPECT_EQ(ReadText(victim), "keep");
    // A plain export: mode 0600 whatever the daemon's umask, bit-exact.
    const std::string out = absl::StrCat(export_dir, "/", d->name(), ".safetensors");
    r = ExportTo(*d, out);
    EXPECT_EQ(r.exit_code, 0) << r.Describe();
    EXPECT_EQ(LstatMode(out) & 07777, 0600u);
    REFIT_ASSERT_OK_AND_ASSIGN(Model got, ReadModel(out));
    EXPECT_EQ(DiffModels(m, got), "");
  }

  // The persisted baseline is never an export target.
  const std::string baseline = Path("baseline/baseline.safetensors");
  const std::string before = ReadText(baseline);
  ASSERT_FALSE(before.empty());
  CommandResult r = ExportTo(*ps_pair.pub, baseline);
  EXPECT_NE(r.exit_code, 0) << r.Describe();
  EXPECT_EQ(ReadText(baseline), before);
}

TEST_F(E2ESecurityFiles, ExportDirOverlappingPersistDirIsAConfigError) {
  PublisherSpec ps;
  ps.persist_dir = Path("baseline");
  ps.export_dir = dir();  // contains the persist_dir
  DaemonProcess& pub = NewPublisher(ps);
  CommandResult r = RunRefitd({"publisher", "--config", pub.config_path()});
  EXPECT_EQ(r.exit_code, 2) << r.Describe();
  EXPECT_TRUE(Contains(r.err, "publisher.files.export_dir")) << r.Describe();
  EXPECT_TRUE(Contains(r.err, "persist_dir")) << r.Describe();
}

TEST_F(E2ESecurityFiles, AFifoAsConfigOrTlsFileIsAPromptClearError) {
  const std::string fifo = Path("config.fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0666), 0);
  for (const char* role : {"publisher", "subscriber"}) {
    CommandResult r = RunRefitd({role, "--config", fifo}, absl::Seconds(20));
    EXPECT_FALSE(r.timed_out) << role << ": " << r.Describe();
    EXPECT_EQ(r.exit_code, 2) << role << ": " << r.Describe();
    EXPECT_TRUE(Contains(r.err, "config.fifo")) << r.Describe();
    EXPECT_TRUE(Contains(r.err, "is a FIFO")) << r.Describe();
  }
  CommandResult r = RunRefitctl({"--target", "127.0.0.1:9", "--tls-cert", fifo, "--tls-key", fifo,
                                 "--tls-ca", fifo, "status"},
                                absl::Seconds(20));
  EXPECT_FALSE(r.timed_out) << r.Describe();
  EXPECT_NE(r.exit_code, 0) << r.Describe();
  EXPECT_TRUE(Contains(r.err, "is a FIFO")) << r.Describe();
}

}  // namespace
}  // namespace refit::e2e
