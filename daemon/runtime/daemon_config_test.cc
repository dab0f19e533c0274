// The config checks of the layer above daemon/config (daemon_config.h): GPU UUIDs and the tensor
// selection, with the file:line errors every config error has.
#include "daemon/runtime/daemon_config.h"

#include <unistd.h>

#include <fstream>
#include <string>

#include "daemon/common/status_matchers.h"
#include "daemon/config/config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::runtime {
namespace {

using ::refit::testing::IsOk;
using ::refit::testing::StatusIs;
using ::testing::HasSubstr;

constexpr char kUuid[] = "GPU-8b1f0011-2233-4455-6677-8899aabbccdd";

std::string Sub(const std::string& extra) {
  return "subscriber:\n  upstream:\n    addresses: [\"127.0.0.2:7400\"]\n  listen: "
         "\"127.0.0.1:0\"\n" +
         extra;
}

TEST(DaemonConfigTest, SubscriberStoreUuidMustBeAGpuUuid) {
  EXPECT_THAT(
      LoadSubscriberDaemonConfigFromString(
          Sub(std::string("  store: {kind: cuda, cuda_device_uuid: ") + kUuid + "}\n"), "sub.yaml")
          .status(),
      IsOk());
  EXPECT_THAT(LoadSubscriberDaemonConfigFromString(
                  Sub("  store: {kind: cuda, cuda_device_uuid: GPU-12}\n"), "sub.yaml")
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("sub.yaml:5:41: subscriber.store.cuda_device_uuid: \"GPU-12\" "
                                 "is not a GPU UUID")));
  // The config layer's own rules still come first, with their text.
  EXPECT_THAT(
      LoadSubscriberDaemonConfigFromString(
          Sub("  store: {kind: cuda, cuda_device: 0, cuda_device_uuid: GPU-12}\n"), "sub.yaml")
          .status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("by ordinal or by UUID, not both")));
  EXPECT_THAT(
      LoadSubscriberDaemonConfigFromString(Sub("  store: {cuda_device_uuid: GPU-12}\n")).status(),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("subscriber.store.cuda_device_uuid: is set, but store.kind is not cuda")));
}

TEST(DaemonConfigTest, PublisherCodecUuidMustBeAGpuUuid) {
  const std::string head = "publisher:\n  listen: \"127.0.0.1:1\"\n";
  EXPECT_THAT(LoadPublisherDaemonConfigFromString(
                  head + "  codec: {device: cuda, cuda_device_uuid: " + kUuid + "}\n")
                  .status(),
              IsOk());
  EXPECT_THAT(LoadPublisherDaemonConfigFromString(
                  head + "  codec: {device: cuda, cuda_device_uuid: nope}\n", "pub.yaml")
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("pub.yaml:3:43: publisher.codec.cuda_device_uuid: \"nope\" is "
                                 "not a GPU UUID")));
}

TEST(DaemonConfigTest, UpstreamTensorsMustBeAValidSelection) {
  const std::string head =
      "subscriber:\n  listen: \"127.0.0.1:0\"\n  upstream:\n    addresses: [\"127.0.0.1:7400\"]\n";
  EXPECT_THAT(LoadSubscriberDaemonConfigFromString(head + "    tensors: [\"layers.*\"]\n").status(),
              IsOk());
  EXPECT_THAT(LoadSubscriberDaemonConfigFromString(
                  head + "    tensors: [\"layers.*\", \"layers.*\"]\n", "sub.yaml")
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("sub.yaml:5:14: subscriber.upstream.tensors: tensors[1]: "
                                 "\"layers.*\" is given twice")));
  EXPECT_THAT(LoadSubscriberDaemonConfigFromString(head + "    tensors: [\"\"]\n").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("subscriber.upstream.tensors: tensors[0]")));
}

TEST(DaemonConfigTest, ConfigLayerAloneDoesNotCheckThese) {
  // daemon/config has no cuda/ or daemon/sync/: these load there and are refused here.
  const std::string bad_uuid = Sub("  store: {kind: cuda, cuda_device_uuid: GPU-12}\n");
  EXPECT_THAT(config::LoadSubscriberConfigFromString(bad_uuid).status(), IsOk());
  EXPECT_THAT(LoadSubscriberDaemonConfigFromString(bad_uuid).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(DaemonConfigTest, FileWithBothSectionsChecksEach) {
  const std::string text = "publisher:\n  listen: \"127.0.0.1:1\"\n" +
                           Sub("  store: {kind: cuda, cuda_device_uuid: GPU-12}\n");
  const std::string path =
      ::testing::TempDir() + "refit_daemon_config_test_" + std::to_string(getpid()) + ".yaml";
  std::ofstream(path) << text;
  EXPECT_THAT(LoadDaemonConfigFile(path).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("subscriber.store.cuda_device_uuid: \"GPU-12\"")));
  std::ofstream(path) << "publisher:\n  listen: \"127.0.0.1:1\"\n";
  EXPECT_THAT(LoadDaemonConfigFile(path).status(), IsOk());
  EXPECT_THAT(LoadPublisherDaemonConfig(path).status(), IsOk());
  EXPECT_THAT(LoadSubscriberDaemonConfig(path).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no 'subscriber:' section")));
  unlink(path.c_str());
}

}  // namespace
}  // namespace refit::runtime
