// DataPlaneService's idle tick: a session with nothing to send looks at the core again every
// tick, so a version the core publishes without a NotifyPublished still goes out (before the
// fix, an idle session waited for a notification forever).
#include <memory>
#include <optional>
#include <vector>

#include "daemon/common/grpc_status_matchers.h"
#include "daemon/common/testing.h"
#include "daemon/serving/data_plane_service.h"
#include "daemon/serving/publisher_testing.h"
#include "daemon/sync/sync_testing.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "refit/v1/data.grpc.pb.h"

namespace refit::publisher {
namespace {

using ::refit::testing::IsOk;
using ::testing::Not;

TEST(DataPlaneTickTest, IdleSessionPicksUpAVersionPublishedWithoutNotification) {
  testing::ModelPublisher model({sync::testing::BF16("w", {64, 64})}, /*seed=*/3, /*change=*/0.02);
  model.PublishNext();
  DataPlaneService service(&model.core(), DataPlaneOptions{.name = "tick"});
  grpc::ServerBuilder builder;
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto stub = v1::DataPlane::NewStub(server->InProcessChannel(grpc::ChannelArguments()));

  grpc::ClientContext ctx;
  ctx.set_deadline(refit::testing::Deadline(30));
  auto stream = stub->Sync(&ctx);
  v1::SubscriberMessage hello;
  v1::Hello* h = hello.mutable_hello();
  h->set_protocol(v1::PROTOCOL_VERSION_1);
  h->set_name("sub");
  h->set_version(1);  // up to date: the session goes idle
  h->set_version_digest(model.digest());
  h->set_lineage(model.core().lineage());
  h->set_max_frame_bytes(1 << 20);
  h->add_patch_formats(1);
  ASSERT_TRUE(stream->Write(hello));
  v1::PublisherMessage m;
  ASSERT_TRUE(stream->Read(&m));
  ASSERT_TRUE(m.has_welcome()) << m.ShortDebugString();

  model.PublishNext();  // version 2, and no NotifyPublished
  ASSERT_TRUE(stream->Read(&m)) << "no transfer of version 2 within the deadline";
  ASSERT_TRUE(m.has_header()) << m.ShortDebugString();
  EXPECT_EQ(m.header().version(), 2u);
  EXPECT_EQ(m.header().base_version(), 1u);
  service.Shutdown();
  ctx.TryCancel();
  EXPECT_THAT(stream->Finish(), Not(IsOk()));
  server->Shutdown();
}

}  // namespace
}  // namespace refit::publisher
