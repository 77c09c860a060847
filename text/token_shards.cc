// llm.c .bin shards and their index (text/token_shards.h).
#include "text/token_shards.h"

#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/exception.h"

namespace ember::text {

int shard_version_for(int64_t vocab_size) { return vocab_size <= 65536 ? 1 : 2; }

void write_token_shard(const std::string& path, std::span<const int32_t> tokens, int version) {
  EMBER_CHECK(version == 1 || version == 2, path, ": version ", version, " is not known (1 = uint16, 2 = uint32)");
  EMBER_CHECK(tokens.size() <= static_cast<size_t>(INT32_MAX), path, ": ", tokens.size(),
              " tokens do not fit a shard's int32 count");
  int32_t header[kShardHeaderInts] = {};
  header[0] = kShardMagic;
  header[1] = version;
  header[2] = static_cast<int32_t>(tokens.size());
  const int64_t limit = version == 1 ? 65536 : (int64_t{1} << 32);
  std::vector<char> body(tokens.size() * (version == 1 ? 2 : 4));
  for (size_t i = 0; i < tokens.size(); ++i) {
    EMBER_CHECK(tokens[i] >= 0 && tokens[i] < limit, path, ": token ", tokens[i], " at ", i, " does not fit version ",
                version, "'s ", version == 1 ? "uint16" : "uint32");
    if (version == 1) {
      const auto v = static_cast<uint16_t>(tokens[i]);
      std::memcpy(body.data() + 2 * i, &v, 2);
    } else {
      const auto v = static_cast<uint32_t>(tokens[i]);
      std::memcpy(body.data() + 4 * i, &v, 4);
    }
  }
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  EMBER_CHECK(out, path, ": cannot create the shard file");
  out.write(reinterpret_cast<const char*>(header), sizeof(header));
  out.write(body.data(), static_cast<std::streamsize>(body.size()));
  out.close();
  EMBER_CHECK(out, path, ": writing the shard file failed");
}

TokenShard read_token_shard(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  EMBER_CHECK(in, path, ": cannot open the shard file");
  const int64_t size = in.tellg();
  in.seekg(0);
  constexpr int64_t kHeaderBytes = kShardHeaderInts * 4;
  EMBER_CHECK(size >= kHeaderBytes, path, ": truncated: ", size, " bytes, shorter than the ", kHeaderBytes,
              "-byte header");
  int32_t header[kShardHeaderInts];
  in.read(reinterpret_cast<char*>(header), kHeaderBytes);
  EMBER_CHECK(header[0] == kShardMagic, path, ": header[0] (magic) is ", header[0], ", not ", kShardMagic,
              ": not an llm.c token file");
  EMBER_CHECK(header[1] == 1 || header[1] == 2, path, ": header[1] (version) is ", header[1],
              "; known versions: 1 (uint16 tokens), 2 (uint32 tokens)");
  EMBER_CHECK(header[2] >= 0, path, ": header[2] (token count) is negative: ", header[2]);
  TokenShard shard;
  shard.version = header[1];
  const int width = shard.version == 1 ? 2 : 4;
  const int64_t body = size - kHeaderBytes, expected = int64_t{header[2]} * width;
  EMBER_CHECK(body >= expected, path, ": truncated: header[2] (token count) says ", header[2], " tokens (", expected,
              " bytes) but the file holds ", body, " bytes after the header");
  EMBER_CHECK(body == expected, path, ": count mismatch: header[2] (token count) says ", header[2],
              " tokens but the file holds ", body, " bytes after the header (", body / width, " tokens)");
  std::vector<char> raw(expected);
  in.read(raw.data(), expected);
  EMBER_CHECK(in, path, ": reading the tokens failed");
  shard.tokens.resize(header[2]);
  for (int64_t i = 0; i < header[2]; ++i) {
    if (width == 2) {
      uint16_t v;
      std::memcpy(&v, raw.data() + 2 * i, 2);
      shard.tokens[i] = v;
    } else {
      std::memcpy(&shard.tokens[i], raw.data() + 4 * i, 4);
    }
  }
  return shard;
}

ShardIndex read_shard_index(const std::string& dir) {
  const std::string path = dir + "/index.json";
  std::ifstream in(path);
  EMBER_CHECK(in, path, ": cannot open the shard index");
  nlohmann::json doc;
  try {
    in >> doc;
  } catch (const nlohmann::json::exception& e) {
    throw Error(path + ": not valid JSON: " + e.what());
  }
  auto field = [&](const char* key) -> const nlohmann::json& {
    EMBER_CHECK(doc.is_object() && doc.contains(key), path, ": ", key, ": missing");
    return doc[key];
  };
  ShardIndex index;
  EMBER_CHECK(field("magic") == kShardMagic, path, ": magic: ", field("magic").dump(), ", not ", kShardMagic);
  EMBER_CHECK(field("version").is_number_integer(), path, ": version: not an integer");
  index.version = field("version").get<int>();
  EMBER_CHECK(index.version == 1 || index.version == 2, path, ": version: ", index.version,
              " is not known (1 = uint16, 2 = uint32)");
  index.vocab_size = field("vocab_size").get<int64_t>();
  index.total_tokens = field("total_tokens").get<int64_t>();
  const auto& tok = field("tokenizer");
  index.tokenizer_path = tok.value("path", "");
  index.tokenizer_hash = tok.value("xxh3_64", "");
  int64_t sum = 0;
  const auto& shards = field("shards");
  EMBER_CHECK(shards.is_array(), path, ": shards: not a list");
  for (size_t i = 0; i < shards.size(); ++i) {
    EMBER_CHECK(shards[i].contains("file") && shards[i].contains("tokens"), path, ": shards[", i,
                "]: needs file and tokens");
    index.shards.push_back({shards[i]["file"].get<std::string>(), shards[i]["tokens"].get<int64_t>()});
    sum += index.shards.back().tokens;
  }
  EMBER_CHECK(sum == index.total_tokens, path, ": total_tokens: ", index.total_tokens, " but the shards hold ", sum);
  return index;
}

ShardWriter::ShardWriter(std::string dir, int64_t tokens_per_shard, int64_t vocab_size, std::string tokenizer_path,
                         std::string tokenizer_hash)
    : dir_(std::move(dir)), per_shard_(tokens_per_shard) {
  EMBER_CHECK(per_shard_ > 0 && per_shard_ <= INT32_MAX, "shard size must be in [1, 2^31), got ", per_shard_);
  index_.version = shard_version_for(vocab_size);
  index_.vocab_size = vocab_size;
  index_.tokenizer_path = std::move(tokenizer_path);
  index_.tokenizer_hash = std::move(tokenizer_hash);
}

void ShardWriter::add(std::span<const int32_t> tokens) {
  while (!tokens.empty()) {
    const size_t room = per_shard_ - buffer_.size();
    const size_t n = std::min(room, tokens.size());
    buffer_.insert(buffer_.end(), tokens.begin(), tokens.begin() + n);
    tokens = tokens.subspan(n);
    if (static_cast<int64_t>(buffer_.size()) == per_shard_) flush();
  }
}

void ShardWriter::flush() {
  char name[32];
  std::snprintf(name, sizeof(name), "shard_%06zu.bin", index_.shards.size());
  write_token_shard(dir_ + "/" + name, buffer_, index_.version);
  index_.shards.push_back({name, static_cast<int64_t>(buffer_.size())});
  index_.total_tokens += buffer_.size();
  buffer_.clear();
}

ShardIndex ShardWriter::finish() {
  if (!buffer_.empty()) flush();
  nlohmann::ordered_json doc;
  doc["format"] = "llm.c token shards";
  doc["magic"] = kShardMagic;
  doc["version"] = index_.version;
  doc["dtype"] = index_.version == 1 ? "uint16" : "uint32";
  doc["vocab_size"] = index_.vocab_size;
  doc["total_tokens"] = index_.total_tokens;
  doc["tokenizer"] = {{"path", index_.tokenizer_path}, {"xxh3_64", index_.tokenizer_hash}};
  nlohmann::ordered_json shards = nlohmann::ordered_json::array();
  for (const auto& s : index_.shards) shards.push_back({{"file", s.file}, {"tokens", s.tokens}});
  doc["shards"] = std::move(shards);
  const std::string path = dir_ + "/index.json";
  std::ofstream out(path, std::ios::trunc);
  EMBER_CHECK(out, path, ": cannot write the shard index");
  out << doc.dump(2) << "\n";
  out.close();
  EMBER_CHECK(out, path, ": writing the shard index failed");
  return index_;
}

}  // namespace ember::text
