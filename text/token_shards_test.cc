// llm.c token shards: round trips of both versions, the writer's cutting
// and index, and every named error of a damaged file.
#include "text/token_shards.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/exception.h"

namespace ember::text {
namespace {

namespace fs = std::filesystem;

std::string temp_dir(const std::string& name) {
  const std::string d = testing::TempDir() + "/" + name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(TokenShards, RoundTripBothVersions) {
  const std::string d = temp_dir("roundtrip");
  const std::vector<int32_t> small = {0, 1, 50256, 65535, 7};
  write_token_shard(d + "/v1.bin", small, 1);
  EXPECT_EQ(fs::file_size(d + "/v1.bin"), 1024u + 2 * small.size());
  TokenShard s = read_token_shard(d + "/v1.bin");
  EXPECT_EQ(s.version, 1);
  EXPECT_EQ(s.tokens, (std::vector<uint32_t>{0, 1, 50256, 65535, 7}));
  const std::vector<int32_t> big = {0, 65536, 128255, 2000000000};
  write_token_shard(d + "/v2.bin", big, 2);
  s = read_token_shard(d + "/v2.bin");
  EXPECT_EQ(s.version, 2);
  EXPECT_EQ(s.tokens, (std::vector<uint32_t>{0, 65536, 128255, 2000000000}));
  // llm.c's header layout, byte for byte.
  std::ifstream in(d + "/v1.bin", std::ios::binary);
  int32_t header[256];
  in.read(reinterpret_cast<char*>(header), sizeof(header));
  EXPECT_EQ(header[0], 20240520);
  EXPECT_EQ(header[1], 1);
  EXPECT_EQ(header[2], 5);
  EXPECT_EQ(header[3], 0);
  EXPECT_EQ(shard_version_for(50257), 1);
  EXPECT_EQ(shard_version_for(65536), 1);
  EXPECT_EQ(shard_version_for(65537), 2);
}

TEST(TokenShards, WriterCutsAndIndexes) {
  const std::string d = temp_dir("writer");
  ShardWriter w(d, 4, 50257, "/x/tokenizer.json", "0123456789abcdef");
  std::vector<int32_t> all;
  for (int i = 0; i < 10; ++i) all.push_back(i * 100);
  w.add(std::span<const int32_t>(all).subspan(0, 3));
  w.add(std::span<const int32_t>(all).subspan(3));
  const ShardIndex written = w.finish();
  ASSERT_EQ(written.shards.size(), 3u);
  const ShardIndex index = read_shard_index(d);
  EXPECT_EQ(index.version, 1);
  EXPECT_EQ(index.vocab_size, 50257);
  EXPECT_EQ(index.total_tokens, 10);
  EXPECT_EQ(index.tokenizer_hash, "0123456789abcdef");
  ASSERT_EQ(index.shards.size(), 3u);
  EXPECT_EQ(index.shards[2].tokens, 2);
  std::vector<uint32_t> back;
  for (const auto& s : index.shards) {
    TokenShard t = read_token_shard(d + "/" + s.file);
    EXPECT_EQ(static_cast<int64_t>(t.tokens.size()), s.tokens);
    back.insert(back.end(), t.tokens.begin(), t.tokens.end());
  }
  EXPECT_EQ(back, std::vector<uint32_t>(all.begin(), all.end()));
}

// A v1 shard of 4 tokens, then `damage` applied to its bytes.
std::string damaged(const std::string& name, const std::function<void(std::string&)>& damage) {
  const std::string d = temp_dir("damaged_" + name);
  write_token_shard(d + "/s.bin", std::vector<int32_t>{1, 2, 3, 4}, 1);
  std::ifstream in(d + "/s.bin", std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  damage(bytes);
  std::ofstream(d + "/s.bin", std::ios::binary | std::ios::trunc) << bytes;
  return error_of([&] { read_token_shard(d + "/s.bin"); });
}

void put_int(std::string& bytes, int index, int32_t v) { std::memcpy(bytes.data() + 4 * index, &v, 4); }

TEST(TokenShards, NamedErrors) {
  std::string e = damaged("magic", [](std::string& b) { put_int(b, 0, 20240801); });
  EXPECT_NE(e.find("header[0] (magic) is 20240801, not 20240520: not an llm.c token file"), std::string::npos) << e;
  e = damaged("version", [](std::string& b) { put_int(b, 1, 3); });
  EXPECT_NE(e.find("header[1] (version) is 3; known versions: 1 (uint16 tokens), 2 (uint32 tokens)"), std::string::npos)
      << e;
  e = damaged("header", [](std::string& b) { b.resize(100); });
  EXPECT_NE(e.find("truncated: 100 bytes, shorter than the 1024-byte header"), std::string::npos) << e;
  e = damaged("body", [](std::string& b) { b.resize(b.size() - 3); });
  EXPECT_NE(e.find("truncated: header[2] (token count) says 4 tokens (8 bytes) but the file holds 5 bytes"),
            std::string::npos)
      << e;
  e = damaged("extra", [](std::string& b) { b += "abcd"; });
  EXPECT_NE(e.find("count mismatch: header[2] (token count) says 4 tokens but the file holds 12 bytes"),
            std::string::npos)
      << e;
  e = damaged("negative", [](std::string& b) { put_int(b, 2, -1); });
  EXPECT_NE(e.find("header[2] (token count) is negative"), std::string::npos) << e;
  EXPECT_NE(error_of([] { read_token_shard("/nonexistent/s.bin"); }).find("/nonexistent/s.bin: cannot open"),
            std::string::npos);
  const std::string d = temp_dir("toolarge");
  e = error_of([&] { write_token_shard(d + "/s.bin", std::vector<int32_t>{1, 70000}, 1); });
  EXPECT_NE(e.find("token 70000 at 1 does not fit version 1's uint16"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(d + "/s.bin"));
  EXPECT_NE(error_of([&] { read_shard_index(d); }).find("index.json: cannot open the shard index"), std::string::npos);
}

}  // namespace
}  // namespace ember::text
