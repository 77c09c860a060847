// Token shards and streams: a v1 and a v2 shard written and read back
// (ids, counts, sizes on disk as llm.c's format says), every named error
// of a bad file, windows across a shard boundary against the ids by hand,
// and a step's batch a function of (seed, step) alone.
#include "data/tokens.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace ember::data {
namespace {

namespace fs = std::filesystem;

fs::path tmpdir() {
  fs::path d = fs::temp_directory_path() / ("ember_tokens_" + std::to_string(::getpid()));
  fs::create_directories(d);
  return d;
}

std::string message(const absl::Status& s) { return std::string(s.message()); }

TEST(TokenShard, WritesAndReadsBothVersions) {
  const fs::path d = tmpdir();
  const std::vector<uint32_t> small = {0, 5, 65535, 7}, big = {1, 70000, 3};
  ASSERT_TRUE(write_token_shard((d / "a_train.bin").string(), small).ok());
  ASSERT_TRUE(write_token_shard((d / "b_train.bin").string(), big).ok());
  EXPECT_EQ(fs::file_size(d / "a_train.bin"), 1024u + 4 * 2);  // header + uint16s
  EXPECT_EQ(fs::file_size(d / "b_train.bin"), 1024u + 3 * 4);  // header + uint32s
  auto a = TokenShard::open((d / "a_train.bin").string());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->version(), 1);
  for (size_t i = 0; i < small.size(); ++i) EXPECT_EQ((**a)[static_cast<int64_t>(i)], small[i]);
  auto b = TokenShard::open((d / "b_train.bin").string(), 70001);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->version(), 2);
  EXPECT_EQ((**b)[1], 70000u);
  // The header's ints as llm.c writes them.
  std::ifstream in(d / "a_train.bin", std::ios::binary);
  int32_t h[3];
  in.read(reinterpret_cast<char*>(h), sizeof h);
  EXPECT_EQ(h[0], 20240520);
  EXPECT_EQ(h[1], 1);
  EXPECT_EQ(h[2], 4);
  EXPECT_NE(message(write_token_shard((d / "c.bin").string(), big, 1)).find("does not fit version 1's uint16"),
            std::string::npos);
  fs::remove_all(d);
}

TEST(TokenShard, BadFilesAreNamedErrors) {
  const fs::path d = tmpdir();
  const std::string p = (d / "x_train.bin").string();
  ASSERT_TRUE(write_token_shard(p, {1, 2, 3, 4}).ok());
  auto patch = [&](int64_t at, int32_t v) {
    std::fstream f(p, std::ios::binary | std::ios::in | std::ios::out);
    f.seekp(at);
    f.write(reinterpret_cast<const char*>(&v), 4);
  };
  EXPECT_NE(message(TokenShard::open(p, 4).status()).find("token 3 is id 4, not below the vocabulary size 4"),
            std::string::npos);
  patch(8, 5);  // the count: 5 tokens but 4 stored
  EXPECT_NE(message(TokenShard::open(p).status())
                .find("says 5 tokens of version 1 (1034 bytes) but the file has 1032 bytes (truncated)"),
            std::string::npos);
  patch(8, 3);
  EXPECT_NE(message(TokenShard::open(p).status()).find("(trailing bytes)"), std::string::npos);
  patch(4, 7);
  EXPECT_NE(message(TokenShard::open(p).status()).find("version 7; supported are 1 (uint16 ids) and 2"),
            std::string::npos);
  patch(0, 1234);
  EXPECT_NE(message(TokenShard::open(p).status()).find("magic 1234, not a token shard's 20240520"), std::string::npos);
  fs::resize_file(p, 100);
  EXPECT_NE(message(TokenShard::open(p).status()).find("shorter than the 1024-byte header"), std::string::npos);
  EXPECT_NE(message(TokenShard::open((d / "none.bin").string()).status()).find("cannot open token shard"),
            std::string::npos);
  EXPECT_NE(message(token_shards(d.string(), "val").status()).find("no token shards (*val*.bin"), std::string::npos);
  fs::remove_all(d);
}

TEST(TokenStream, WindowsCrossShardsAndBatchesDependOnSeedAndStepOnly) {
  const fs::path d = tmpdir();
  ASSERT_TRUE(write_token_shard((d / "t_train_000001.bin").string(), {10, 11, 12}).ok());
  ASSERT_TRUE(write_token_shard((d / "t_train_000002.bin").string(), {13, 14, 15, 16}).ok());
  ASSERT_TRUE(write_token_shard((d / "t_val_000000.bin").string(), {1}).ok());
  auto paths = token_shards(d.string(), "train");
  ASSERT_TRUE(paths.ok());
  ASSERT_EQ(paths->size(), 2u);
  auto s = TokenStream::open(*paths, 17);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->size(), 7);
  auto [x, y] = s->windows({1, 3}, 3);
  EXPECT_EQ(x.to_vector(), (std::vector<double>{11, 12, 13, 13, 14, 15}));
  EXPECT_EQ(y.to_vector(), (std::vector<double>{12, 13, 14, 14, 15, 16}));
  EXPECT_EQ(s->batch_starts(3, 5, 8, 3), s->batch_starts(3, 5, 8, 3));
  EXPECT_NE(s->batch_starts(3, 5, 8, 3), s->batch_starts(3, 6, 8, 3));
  for (int64_t b : s->batch_starts(1, 0, 50, 3)) EXPECT_TRUE(b >= 0 && b + 3 < 7) << b;
  // The same tokens in memory give the same windows.
  TokenStream m = TokenStream::from_ids({10, 11, 12, 13, 14, 15, 16});
  EXPECT_EQ(m.windows({1, 3}, 3).first.to_vector(), x.to_vector());
  EXPECT_EQ(s->counts(17)[13], 1);
  fs::remove_all(d);
}

}  // namespace
}  // namespace ember::data
