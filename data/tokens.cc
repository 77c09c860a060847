// llm.c .bin token shards and token streams (see tokens.h).
#include "data/tokens.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

namespace ember::data {

absl::Status write_token_shard(const std::string& path, const std::vector<uint32_t>& ids, int version) {
  const uint32_t top = ids.empty() ? 0 : *std::max_element(ids.begin(), ids.end());
  if (version == 0) version = top <= 0xFFFF ? 1 : 2;
  if (version != 1 && version != 2)
    return absl::InvalidArgumentError(absl::StrCat(path, ": token shard version ", version, " (1: uint16, 2: uint32)"));
  if (version == 1 && top > 0xFFFF)
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": token id ", top, " does not fit version 1's uint16 (use version 2)"));
  if (ids.size() > static_cast<size_t>(INT32_MAX))
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", ids.size(), " tokens exceed a shard's int32 count"));
  std::vector<int32_t> header(kTokenHeaderInts, 0);
  header[0] = kTokenShardMagic;
  header[1] = version;
  header[2] = static_cast<int32_t>(ids.size());
  // Written beside, then renamed: a shard is whole or absent.
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot write (", std::strerror(errno), ")"));
    out.write(reinterpret_cast<const char*>(header.data()), kTokenHeaderInts * 4);
    if (version == 1) {
      std::vector<uint16_t> narrow(ids.begin(), ids.end());
      out.write(reinterpret_cast<const char*>(narrow.data()), static_cast<std::streamsize>(narrow.size() * 2));
    } else {
      out.write(reinterpret_cast<const char*>(ids.data()), static_cast<std::streamsize>(ids.size() * 4));
    }
    if (!out.flush()) return absl::DataLossError(absl::StrCat(path, ": write failed (disk full?)"));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot rename into place: ", ec.message()));
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<TokenShard>> TokenShard::open(const std::string& path, int64_t vocab) {
  std::shared_ptr<TokenShard> s(new TokenShard());
  s->path_ = path;
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return absl::NotFoundError(absl::StrCat(path, ": cannot open token shard (", std::strerror(errno), ")"));
  struct stat st {};
  ::fstat(fd, &st);
  const size_t bytes = static_cast<size_t>(st.st_size);
  if (bytes < kTokenHeaderInts * 4) {
    ::close(fd);
    return absl::DataLossError(absl::StrCat(path, ": ", bytes, " bytes, shorter than the ", kTokenHeaderInts * 4,
                                            "-byte header of a token shard (truncated, or not one)"));
  }
  void* m = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) return absl::InternalError(absl::StrCat(path, ": mmap failed (", std::strerror(errno), ")"));
  s->map_ = m;
  s->map_bytes_ = bytes;
  const int32_t* h = static_cast<const int32_t*>(m);
  if (h[0] != kTokenShardMagic)
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": magic ", h[0], ", not a token shard's ", kTokenShardMagic, " (llm.c's .bin format)"));
  if (h[1] != 1 && h[1] != 2)
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": token shard version ", h[1], "; supported are 1 (uint16 ids) and 2 (uint32 ids)"));
  if (h[2] < 0) return absl::InvalidArgumentError(absl::StrCat(path, ": negative token count ", h[2]));
  s->version_ = h[1];
  s->count_ = h[2];
  const size_t want = kTokenHeaderInts * 4 + static_cast<size_t>(s->count_) * (s->version_ == 1 ? 2 : 4);
  if (bytes != want)
    return absl::DataLossError(absl::StrCat(path, ": the header says ", s->count_, " tokens of version ", s->version_,
                                            " (", want, " bytes) but the file has ", bytes, " bytes",
                                            bytes < want ? " (truncated)" : " (trailing bytes)"));
  s->tokens_ = static_cast<const char*>(m) + kTokenHeaderInts * 4;
  if (vocab > 0)
    for (int64_t i = 0; i < s->count_; ++i)
      if ((*s)[i] >= static_cast<uint64_t>(vocab))
        return absl::InvalidArgumentError(absl::StrCat(path, ": token ", i, " is id ", (*s)[i],
                                                       ", not below the vocabulary size ", vocab,
                                                       " (tokenized with another tokenizer?)"));
  return s;
}

TokenShard::~TokenShard() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

absl::StatusOr<TokenStream> TokenStream::open(const std::vector<std::string>& paths, int64_t vocab) {
  if (paths.empty()) return absl::InvalidArgumentError("token stream: no shards given");
  TokenStream t;
  for (const auto& p : paths) {
    auto s = TokenShard::open(p, vocab);
    if (!s.ok()) return s.status();
    t.offsets_.push_back(t.total_);
    t.total_ += (*s)->size();
    t.shards_.push_back(*std::move(s));
  }
  t.offsets_.push_back(t.total_);
  return t;
}

TokenStream TokenStream::from_ids(std::vector<uint32_t> ids) {
  TokenStream t;
  t.total_ = static_cast<int64_t>(ids.size());
  t.ids_ = std::move(ids);
  return t;
}

uint32_t TokenStream::operator[](int64_t i) const {
  if (shards_.empty()) return ids_[static_cast<size_t>(i)];
  const size_t k = static_cast<size_t>(std::upper_bound(offsets_.begin(), offsets_.end(), i) - offsets_.begin()) - 1;
  return (*shards_[k])[i - offsets_[k]];
}

std::pair<Tensor, Tensor> TokenStream::windows(const std::vector<int64_t>& starts, int64_t seq) const {
  const int64_t n = static_cast<int64_t>(starts.size());
  Tensor x = Tensor::empty({n, seq}, {DType::Int64}), y = Tensor::empty({n * seq}, {DType::Int64});
  int64_t *xp = x.data<int64_t>(), *yp = y.data<int64_t>();
  for (int64_t w = 0; w < n; ++w) {
    const int64_t s = starts[w];
    EMBER_CHECK(s >= 0 && s + seq < total_, "token windows: start ", s, " with ", seq + 1, " tokens is outside the ",
                total_, " tokens of the stream");
    for (int64_t t = 0; t <= seq; ++t) {
      const int64_t id = (*this)[s + t];
      if (t < seq) xp[w * seq + t] = id;
      if (t > 0) yp[w * seq + t - 1] = id;
    }
  }
  return {x, y};
}

std::vector<int64_t> TokenStream::batch_starts(uint64_t seed, int64_t step, int64_t n, int64_t seq) const {
  EMBER_CHECK(total_ > seq + 1, "token stream: ", total_, " tokens are too few for windows of ", seq + 1);
  std::mt19937_64 g(seed * 1000003ULL + static_cast<uint64_t>(step) * 7919ULL);
  std::uniform_int_distribution<int64_t> pick(0, total_ - seq - 2);
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < n; ++i) starts.push_back(pick(g));
  return starts;
}

std::vector<int64_t> TokenStream::counts(int64_t vocab, int64_t limit) const {
  std::vector<int64_t> c(static_cast<size_t>(vocab), 0);
  for (int64_t i = 0; i < std::min(total_, limit); ++i) {
    const uint32_t id = (*this)[i];
    EMBER_CHECK(id < static_cast<uint64_t>(vocab), "token stream: id ", id, " at ", i, " is not below the vocabulary ",
                vocab);
    ++c[id];
  }
  return c;
}

uint32_t TokenStream::max_id() const {
  uint32_t m = 0;
  for (int64_t i = 0; i < total_; ++i) m = std::max(m, (*this)[i]);
  return m;
}

absl::StatusOr<ShardIndex> read_shard_index(const std::string& dir) {
  const std::string path = dir + "/index.json";
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open the shard index"));
  nlohmann::json doc = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object())
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  auto bad = [&](const std::string& field, const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", field, ": ", why));
  };
  for (const char* key : {"magic", "version", "vocab_size", "total_tokens", "shards"})
    if (!doc.contains(key)) return bad(key, "missing");
  if (doc["magic"] != kTokenShardMagic) return bad("magic", doc["magic"].dump() + ", not 20240520");
  ShardIndex index;
  if (!doc["version"].is_number_integer() || (doc["version"] != 1 && doc["version"] != 2))
    return bad("version", doc["version"].dump() + " is not known (1 = uint16, 2 = uint32)");
  index.version = doc["version"].get<int>();
  if (!doc["vocab_size"].is_number_integer() || doc["vocab_size"].get<int64_t>() <= 0)
    return bad("vocab_size", doc["vocab_size"].dump() + " is not a positive integer");
  index.vocab_size = doc["vocab_size"].get<int64_t>();
  index.total_tokens = doc["total_tokens"].get<int64_t>();
  if (doc.contains("tokenizer") && doc["tokenizer"].is_object()) {
    index.tokenizer_path = doc["tokenizer"].value("path", "");
    index.tokenizer_hash = doc["tokenizer"].value("xxh3_64", "");
  }
  if (!doc["shards"].is_array()) return bad("shards", "not a list");
  int64_t sum = 0;
  for (size_t i = 0; i < doc["shards"].size(); ++i) {
    const auto& e = doc["shards"][i];
    if (!e.is_object() || !e.contains("file") || !e.contains("tokens"))
      return bad(absl::StrCat("shards[", i, "]"), "needs file and tokens");
    index.shards.push_back({e["file"].get<std::string>(), e.value("split", "train"), e["tokens"].get<int64_t>()});
    sum += index.shards.back().tokens;
  }
  if (sum != index.total_tokens)
    return bad("total_tokens", absl::StrCat(index.total_tokens, " but the shards hold ", sum));
  return index;
}

ShardWriter::ShardWriter(std::string dir, int64_t tokens_per_shard, int64_t vocab_size, std::string tokenizer_path,
                         std::string tokenizer_hash)
    : dir_(std::move(dir)), per_shard_(tokens_per_shard) {
  EMBER_CHECK(per_shard_ > 0 && per_shard_ <= INT32_MAX, "token shards: shard size must be in [1, 2^31), got ",
              per_shard_);
  EMBER_CHECK(vocab_size > 0 && vocab_size <= (int64_t{1} << 32), "token shards: vocabulary size ", vocab_size,
              " must be in [1, 2^32]");
  index_.version = vocab_size <= 65536 ? 1 : 2;
  index_.vocab_size = vocab_size;
  index_.tokenizer_path = std::move(tokenizer_path);
  index_.tokenizer_hash = std::move(tokenizer_hash);
}

absl::Status ShardWriter::add(const std::string& split, const std::vector<uint32_t>& ids) {
  auto it = std::find_if(buffers_.begin(), buffers_.end(), [&](const auto& b) { return b.first == split; });
  if (it == buffers_.end()) it = buffers_.insert(buffers_.end(), {split, {}});
  for (size_t i = 0; i < ids.size();) {
    const size_t n = std::min(ids.size() - i, static_cast<size_t>(per_shard_) - it->second.size());
    it->second.insert(it->second.end(), ids.begin() + i, ids.begin() + i + n);
    i += n;
    if (static_cast<int64_t>(it->second.size()) == per_shard_)
      if (absl::Status st = flush(split); !st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status ShardWriter::flush(const std::string& split) {
  auto buf = std::find_if(buffers_.begin(), buffers_.end(), [&](const auto& b) { return b.first == split; });
  auto count = std::find_if(counts_.begin(), counts_.end(), [&](const auto& c) { return c.first == split; });
  if (count == counts_.end()) count = counts_.insert(counts_.end(), {split, 0});
  char name[64];
  std::snprintf(name, sizeof name, "%s_%06d.bin", split.c_str(), count->second++);
  if (absl::Status st = write_token_shard(dir_ + "/" + name, buf->second, index_.version); !st.ok()) return st;
  index_.shards.push_back({name, split, static_cast<int64_t>(buf->second.size())});
  index_.total_tokens += static_cast<int64_t>(buf->second.size());
  buf->second.clear();
  return absl::OkStatus();
}

absl::StatusOr<ShardIndex> ShardWriter::finish() {
  for (auto& [split, ids] : buffers_)
    if (!ids.empty())
      if (absl::Status st = flush(split); !st.ok()) return st;
  nlohmann::ordered_json doc;
  doc["format"] = "llm.c token shards";
  doc["magic"] = kTokenShardMagic;
  doc["version"] = index_.version;
  doc["dtype"] = index_.version == 1 ? "uint16" : "uint32";
  doc["vocab_size"] = index_.vocab_size;
  doc["total_tokens"] = index_.total_tokens;
  doc["tokenizer"] = {{"path", index_.tokenizer_path}, {"xxh3_64", index_.tokenizer_hash}};
  nlohmann::ordered_json shards = nlohmann::ordered_json::array();
  for (const auto& sh : index_.shards)
    shards.push_back({{"file", sh.file}, {"split", sh.split}, {"tokens", sh.tokens}});
  doc["shards"] = std::move(shards);
  const std::string path = dir_ + "/index.json";
  std::ofstream out(path, std::ios::trunc);
  out << doc.dump(2) << "\n";
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat(path, ": writing the shard index failed"));
  return index_;
}

absl::StatusOr<std::vector<std::string>> token_shards(const std::string& dir, const std::string& split) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec))
    return absl::NotFoundError(absl::StrCat(dir, ": not a directory of token shards"));
  std::vector<std::string> out;
  if (std::filesystem::exists(dir + "/index.json")) {
    auto index = read_shard_index(dir);
    if (!index.ok()) return index.status();
    for (const auto& sh : index->shards)
      if (sh.split == split) out.push_back(dir + "/" + sh.file);
  } else {
    for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
      const std::string name = e.path().filename().string();
      if (e.is_regular_file() && e.path().extension() == ".bin" && name.find(split) != std::string::npos)
        out.push_back(e.path().string());
    }
    std::sort(out.begin(), out.end());
  }
  if (out.empty())
    return absl::NotFoundError(
        absl::StrCat(dir, ": no ", split, " token shards (index.json's, or *", split, "*.bin as llm.c names them)"));
  return out;
}

}  // namespace ember::data
