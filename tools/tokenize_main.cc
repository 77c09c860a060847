// //tools:tokenize: byte-level BPE tokenization from the command line
// (//text): token shards for training, ids for scripts, training a
// tokenizer, and encoding throughput. kUsage below is the manual.
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "core/exception.h"
#include "data/tokens.h"
#include "text/bpe_trainer.h"
#include "text/regex.h"
#include "text/tokenizer.h"

namespace {

namespace fs = std::filesystem;
using ember::Error;
using namespace ember::text;

const char* kUsage =
    "usage:\n"
    "  tokenize --tokenizer T.json --out DIR [--shard-tokens N] [--eot TOKEN] [--split-on LINE]\n"
    "           [--val-every K] FILE...\n"
    "      token shards in llm.c's .bin format: DIR/train_000000.bin, ... of N tokens each (default\n"
    "      100000000; the last one shorter), DIR/val_000000.bin, ... with --val-every, and\n"
    "      DIR/index.json (shards, splits, counts, vocab size, dtype, the tokenizer's path and xxh3\n"
    "      hash). Each FILE is one document, encoded whole, or, with --split-on LINE, the documents\n"
    "      between lines equal to LINE (fortunes' \"%\"); with --val-every K every K-th document is held\n"
    "      out for validation. With --eot its token goes before each document (as llm.c's data\n"
    "      scripts do). Header: 256 int32, magic 20240520, version 1 = uint16 tokens (vocabularies up\n"
    "      to 65,536), 2 = uint32 (ours), count. DIR must be new or empty; on an error nothing is left.\n"
    "  tokenize --tokenizer T.json --print [FILE...]\n"
    "      the ids of each FILE (standard input without one), space-separated, one line per input.\n"
    "  tokenize --tokenizer T.json --decode [--skip-special]\n"
    "      the text (bytes) of the ids on standard input (separated by white space).\n"
    "  tokenize --train --vocab-size N [--merges M] [--min-frequency F] [--special TOKEN]...\n"
    "           [--add-prefix-space] --out T.json FILE...\n"
    "      trains a byte-level BPE vocabulary on the FILEs' lines as Hugging Face's BpeTrainer with a\n"
    "      ByteLevel pre-tokenizer and the 256-byte initial alphabet: special tokens, then bytes, then\n"
    "      merges until N tokens (or M merges), pairs seen fewer than F times never merged.\n"
    "  tokenize --tokenizer T.json --bench [--rounds R] [--lines] FILE...\n"
    "      encoding throughput on one thread: each FILE encoded whole (with --lines: each line, with\n"
    "      its ending, by itself), R timed rounds (default 5) after one warm-up; prints each round's\n"
    "      MB/s and the median.\n";

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr, "tokenize: %s\n%s", msg.c_str(), kUsage);
  std::exit(2);
}

int64_t whole_number(const std::string& flag, const std::string& text, int64_t min) {
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || v < min)
    usage_error(flag + " wants a whole number >= " + std::to_string(min) + ", got '" + text + "'");
  return v;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EMBER_CHECK(in, path, ": cannot open");
  std::ostringstream ss;
  ss << in.rdbuf();
  EMBER_CHECK(in.good() || in.eof(), path, ": reading failed");
  return ss.str();
}

// A document's text, checked here so the error names the file.
std::string read_text(const std::string& path) {
  std::string text = path == "-" ? std::string(std::istreambuf_iterator<char>(std::cin), {}) : read_file(path);
  const size_t bad = find_invalid_utf8(text);
  EMBER_CHECK(bad == std::string::npos, path == "-" ? "standard input" : path, ": not valid UTF-8 at byte ", bad);
  return text;
}

std::string file_hash(const std::string& path) {
  const std::string bytes = read_file(path);
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(XXH3_64bits(bytes.data(), bytes.size())));
  return hex;
}

struct Args {
  std::string tokenizer, out, eot, split_on;
  bool print = false, decode = false, train = false, bench = false, skip_special = false, prefix_space = false,
       lines = false;
  int64_t shard_tokens = 100'000'000, vocab_size = -1, merges = -1, min_frequency = 0, rounds = 5, val_every = 0;
  std::vector<std::string> specials, files;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(f + " needs a value");
      return argv[++i];
    };
    if (f == "--help" || f == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (f == "--tokenizer") {
      a.tokenizer = value();
    } else if (f == "--out") {
      a.out = value();
    } else if (f == "--eot") {
      a.eot = value();
    } else if (f == "--split-on") {
      a.split_on = value();
    } else if (f == "--val-every") {
      a.val_every = whole_number(f, value(), 2);
    } else if (f == "--shard-tokens") {
      a.shard_tokens = whole_number(f, value(), 1);
    } else if (f == "--vocab-size") {
      a.vocab_size = whole_number(f, value(), 1);
    } else if (f == "--merges") {
      a.merges = whole_number(f, value(), 0);
    } else if (f == "--min-frequency") {
      a.min_frequency = whole_number(f, value(), 0);
    } else if (f == "--rounds") {
      a.rounds = whole_number(f, value(), 1);
    } else if (f == "--special") {
      a.specials.push_back(value());
    } else if (f == "--print") {
      a.print = true;
    } else if (f == "--decode") {
      a.decode = true;
    } else if (f == "--train") {
      a.train = true;
    } else if (f == "--bench") {
      a.bench = true;
    } else if (f == "--skip-special") {
      a.skip_special = true;
    } else if (f == "--lines") {
      a.lines = true;
    } else if (f == "--add-prefix-space") {
      a.prefix_space = true;
    } else if (f.size() > 1 && f[0] == '-') {
      usage_error("unknown flag '" + f + "'");
    } else {
      a.files.push_back(f);
    }
  }
  const int modes = a.print + a.decode + a.train + a.bench;
  if (modes > 1) usage_error("--print, --decode, --train and --bench exclude each other");
  if (a.train) {
    if (!a.tokenizer.empty()) usage_error("--train writes a tokenizer (--out); it takes no --tokenizer");
    if (a.vocab_size < 0 && a.merges < 0) usage_error("--train needs --vocab-size N (or --merges M)");
    if (a.out.empty()) usage_error("--train needs --out T.json");
    if (a.files.empty()) usage_error("--train needs corpus FILEs");
  } else {
    if (a.tokenizer.empty()) usage_error("--tokenizer T.json is required");
    if (modes == 0) {
      if (a.out.empty()) usage_error("give --out DIR (shards), --print, --decode, --train or --bench");
      if (a.files.empty()) usage_error("--out DIR needs input FILEs");
    }
    if (a.bench && a.files.empty()) usage_error("--bench needs FILEs");
    if (a.decode && !a.files.empty()) usage_error("--decode reads ids from standard input only");
  }
  return a;
}

int train(const Args& a) {
  TrainOptions opt;
  opt.vocab_size = a.vocab_size < 0 ? INT64_MAX : a.vocab_size;
  opt.max_merges = a.merges;
  opt.min_frequency = a.min_frequency;
  opt.special_tokens = a.specials;
  opt.add_prefix_space = a.prefix_space;
  BpeTrainer trainer(opt);
  for (const std::string& f : a.files) trainer.feed_file(f);
  const Tokenizer tok = trainer.train();
  tok.save(a.out);
  std::fprintf(stderr, "tokenize: %zu distinct words, %zu merges, %lld tokens -> %s\n", trainer.word_count(),
               tok.model().merges().size(), static_cast<long long>(tok.vocab_size()), a.out.c_str());
  return 0;
}

int print(const Tokenizer& tok, const Args& a) {
  std::vector<std::string> inputs = a.files.empty() ? std::vector<std::string>{"-"} : a.files;
  std::vector<int32_t> ids;
  std::string line;
  for (const std::string& f : inputs) {
    ids.clear();
    tok.encode(read_text(f), ids);
    line.clear();
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i) line += ' ';
      line += std::to_string(ids[i]);
    }
    line += '\n';
    std::fwrite(line.data(), 1, line.size(), stdout);
  }
  return 0;
}

int decode(const Tokenizer& tok, const Args& a) {
  std::vector<int32_t> ids;
  std::string word;
  for (size_t n = 0; std::cin >> word; ++n) {
    char* end = nullptr;
    const long long v = std::strtoll(word.c_str(), &end, 10);
    EMBER_CHECK(*end == '\0' && v >= 0 && v < tok.vocab_size(), "standard input: token ", n, " '", word,
                "' is not an id in [0, ", tok.vocab_size(), ")");
    ids.push_back(static_cast<int32_t>(v));
  }
  const std::string text = tok.decode(ids, a.skip_special);
  std::fwrite(text.data(), 1, text.size(), stdout);
  return 0;
}

int bench(const Tokenizer& tok, const Args& a) {
  std::vector<std::string> docs;
  size_t bytes = 0;
  for (const std::string& f : a.files) {
    std::string text = read_text(f);
    bytes += text.size();
    if (!a.lines) {
      docs.push_back(std::move(text));
      continue;
    }
    for (size_t pos = 0; pos < text.size();) {
      const size_t nl = text.find('\n', pos);
      const size_t end = nl == std::string::npos ? text.size() : nl + 1;
      docs.push_back(text.substr(pos, end - pos));
      pos = end;
    }
  }
  std::vector<int32_t> ids;
  std::vector<double> rates;
  size_t tokens = 0;
  for (int64_t r = -1; r < a.rounds; ++r) {  // round -1: warm-up (the word cache, page faults)
    tokens = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (const std::string& d : docs) {
      ids.clear();
      tok.encode(d, ids);
      tokens += ids.size();
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r < 0) continue;
    rates.push_back(bytes / s / 1e6);
    std::printf("round %lld: %.2f MB/s (%zu bytes, %zu tokens, %.3f s)\n", static_cast<long long>(r), rates.back(),
                bytes, tokens, s);
  }
  std::vector<double> sorted = rates;
  std::sort(sorted.begin(), sorted.end());
  std::printf("median: %.2f MB/s\n", sorted[sorted.size() / 2]);
  return 0;
}

int shards(const Tokenizer& tok, const Args& a) {
  std::optional<int32_t> eot;
  if (!a.eot.empty()) {
    eot = tok.token_to_id(a.eot);
    EMBER_CHECK(eot, "--eot: '", a.eot, "' is not a token of ", a.tokenizer);
  }
  const fs::path out(a.out);
  EMBER_CHECK(!fs::exists(out) || (fs::is_directory(out) && fs::is_empty(out)), a.out,
              ": exists and is not an empty directory; give a new one");
  // Written to a sibling and renamed at the end: a failure leaves no
  // partial shards in DIR.
  const fs::path staging = out.string() + ".partial-" + std::to_string(::getpid());
  fs::remove_all(staging);
  fs::create_directories(staging);
  try {
    ember::data::ShardWriter writer(staging.string(), a.shard_tokens, tok.vocab_size(),
                                    fs::absolute(a.tokenizer).string(), file_hash(a.tokenizer));
    std::vector<int32_t> ids;
    int64_t doc = 0;
    auto add = [&](const std::string& text) {
      ids.clear();
      if (eot) ids.push_back(*eot);
      tok.encode(text, ids);
      const bool val = a.val_every > 0 && doc % a.val_every == a.val_every - 1;
      ++doc;
      const absl::Status st = writer.add(val ? "val" : "train", std::vector<uint32_t>(ids.begin(), ids.end()));
      EMBER_CHECK(st.ok(), st.message());
    };
    for (const std::string& f : a.files) {
      const std::string text = read_text(f);
      if (a.split_on.empty()) {
        add(text);
        continue;
      }
      // Documents between lines equal to --split-on, each with its lines' endings.
      std::string cur;
      std::istringstream in(text);
      for (std::string line; std::getline(in, line);) {
        if (line == a.split_on) {
          if (!cur.empty()) add(cur);
          cur.clear();
        } else {
          cur += line + "\n";
        }
      }
      if (!cur.empty()) add(cur);
    }
    const auto index = writer.finish();
    EMBER_CHECK(index.ok(), index.status().message());
    if (fs::exists(out)) fs::remove(out);  // empty, checked above
    fs::rename(staging, out);
    int64_t val_tokens = 0;
    for (const auto& sh : index->shards) val_tokens += sh.split == "val" ? sh.tokens : 0;
    std::fprintf(stderr, "tokenize: %lld tokens (%lld held out) from %lld documents in %zu shards (%s) -> %s\n",
                 static_cast<long long>(index->total_tokens), static_cast<long long>(val_tokens),
                 static_cast<long long>(doc), index->shards.size(), index->version == 1 ? "uint16" : "uint32",
                 a.out.c_str());
  } catch (...) {
    fs::remove_all(staging);
    throw;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  try {
    if (a.train) return train(a);
    const Tokenizer tok = Tokenizer::from_file(a.tokenizer);
    if (a.print) return print(tok, a);
    if (a.decode) return decode(tok, a);
    if (a.bench) return bench(tok, a);
    return shards(tok, a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tokenize: %s\n", e.what());
    return 1;
  }
}
