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
  EXPECT_NE(message(token_shards(d.string(), "val").status()).find("no val token shards (index.json's, or *val*.bin"),
            std::string::npos);
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

// The writer cuts each split into shards of N tokens named by split, and
// index.json lists them; token_shards reads the split's back in order.
TEST(ShardWriter, CutsSplitsAndIndexes) {
  const fs::path d = tmpdir();
  ShardWriter w(d.string(), 4, 50257, "/x/tokenizer.json", "0123456789abcdef");
  std::vector<uint32_t> all;
  for (uint32_t i = 0; i < 10; ++i) all.push_back(i * 100);
  ASSERT_TRUE(w.add("train", std::vector<uint32_t>(all.begin(), all.begin() + 3)).ok());
  ASSERT_TRUE(w.add("val", {7, 8}).ok());
  ASSERT_TRUE(w.add("train", std::vector<uint32_t>(all.begin() + 3, all.end())).ok());
  auto written = w.finish();
  ASSERT_TRUE(written.ok()) << written.status();
  auto index = read_shard_index(d.string());
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(index->version, 1);
  EXPECT_EQ(index->vocab_size, 50257);
  EXPECT_EQ(index->total_tokens, 12);
  EXPECT_EQ(index->tokenizer_hash, "0123456789abcdef");
  ASSERT_EQ(index->shards.size(), 4u);  // train 4 + 4 + 2, val 2
  auto train = token_shards(d.string(), "train");
  ASSERT_TRUE(train.ok());
  EXPECT_EQ(train->back(), (d / "train_000002.bin").string());
  auto s = TokenStream::open(*train, 50257);
  ASSERT_TRUE(s.ok());
  std::vector<uint32_t> back;
  for (int64_t i = 0; i < s->size(); ++i) back.push_back((*s)[i]);
  EXPECT_EQ(back, all);
  auto val = token_shards(d.string(), "val");
  ASSERT_TRUE(val.ok());
  EXPECT_EQ(val->size(), 1u);
  // A damaged index is a named error.
  std::ofstream(d / "index.json")
      << R"({"magic": 20240520, "version": 3, "vocab_size": 5, "total_tokens": 0, "shards": []})";
  EXPECT_NE(message(read_shard_index(d.string()).status()).find("index.json: version: 3 is not known"),
            std::string::npos);
  fs::remove_all(d);
}

}  // namespace
}  // namespace ember::data
