#include "daemon/publisher/join_buffers.h"

#include <cstdint>
#include <memory>

#include "gtest/gtest.h"

namespace refit::publisher {
namespace {

TEST(JoinBufferPoolTest, ABufferReturnsToThePoolAndIsTakenAgain) {
  auto pool = std::make_shared<JoinBufferPool>();
  pool->set_max_free_bytes(1000);
  std::shared_ptr<uint8_t> a = pool->Take(600);
  uint8_t* const first = a.get();
  a.reset();
  EXPECT_EQ(pool->free_bytes(), 600u);
  std::shared_ptr<uint8_t> other_size = pool->Take(300);  // a new one: no free buffer of 300
  EXPECT_NE(other_size.get(), first);
  EXPECT_EQ(pool->free_bytes(), 600u);
  std::shared_ptr<uint8_t> b = pool->Take(600);
  EXPECT_EQ(b.get(), first);
  EXPECT_EQ(pool->free_bytes(), 0u);
}

TEST(JoinBufferPoolTest, KeepsAtMostMaxFreeBytes) {
  auto pool = std::make_shared<JoinBufferPool>();
  pool->set_max_free_bytes(1000);
  std::shared_ptr<uint8_t> a = pool->Take(600), b = pool->Take(600);
  a.reset();
  b.reset();  // beyond the cap: freed
  EXPECT_EQ(pool->free_bytes(), 600u);
  pool->set_max_free_bytes(0);  // the trainer's sliced tensors are gone
  EXPECT_EQ(pool->free_bytes(), 0u);
}

TEST(JoinBufferPoolTest, ABufferOutlivingItsPoolIsFreed) {
  auto pool = std::make_shared<JoinBufferPool>();
  pool->set_max_free_bytes(1000);
  std::shared_ptr<uint8_t> a = pool->Take(100);
  a.get()[99] = 7;
  pool.reset();
  a.reset();  // no pool to return to (ASan: no leak, no use after free)
}

}  // namespace
}  // namespace refit::publisher
