// Byte-level BPE encoding throughput on one thread (bytes/s), and training
// time. Defaults to text/testdata (Hugging Face's 800-token tokenizer, the
// sample and corpus texts); EMBER_TOKENIZER=T.json and EMBER_TEXT=FILE
// measure another pair. Hugging Face beside it: bench/tokenizer_compare.py.
//
//   bazel run -c opt //bench:tokenizer_bench
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "text/bpe_trainer.h"
#include "text/tokenizer.h"

namespace {
using namespace ember::text;

std::string env_or(const char* name, const char* dflt) {
  const char* v = std::getenv(name);
  return v && *v ? v : dflt;
}

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "tokenizer_bench: cannot read %s (run through bazel run, or set EMBER_TEXT)\n", path.c_str());
    std::exit(1);
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

const std::string& text() {
  static const std::string t = std::getenv("EMBER_TEXT")
                                   ? read(std::getenv("EMBER_TEXT"))
                                   : read("text/testdata/sample.txt") + read("text/testdata/corpus.txt");
  return t;
}

const std::string tokenizer_path() { return env_or("EMBER_TOKENIZER", "text/testdata/hf_bpe.json"); }

// The whole text in one encode() call; the word cache warm after the first
// iteration, as in steady-state tokenization of a corpus.
void BM_EncodeDocument(benchmark::State& state) {
  const Tokenizer tok = Tokenizer::from_file(tokenizer_path());
  std::vector<int32_t> ids;
  for (auto _ : state) {
    ids.clear();
    tok.encode(text(), ids);
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * text().size());
  state.counters["tokens"] = ids.size();
}
BENCHMARK(BM_EncodeDocument)->Unit(benchmark::kMillisecond);

// Line by line (each with its newline): per-call overhead shows.
void BM_EncodeLines(benchmark::State& state) {
  const Tokenizer tok = Tokenizer::from_file(tokenizer_path());
  std::vector<std::string_view> lines;
  const std::string& t = text();
  for (size_t pos = 0; pos < t.size();) {
    const size_t nl = t.find('\n', pos);
    const size_t end = nl == std::string::npos ? t.size() : nl + 1;
    lines.push_back(std::string_view(t).substr(pos, end - pos));
    pos = end;
  }
  std::vector<int32_t> ids;
  for (auto _ : state) {
    for (std::string_view l : lines) {
      ids.clear();
      tok.encode(l, ids);
    }
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * t.size());
}
BENCHMARK(BM_EncodeLines)->Unit(benchmark::kMillisecond);

// A fresh tokenizer (so an empty word cache) every iteration: the BPE
// merges themselves, plus loading the tokenizer.json.
void BM_EncodeColdCache(benchmark::State& state) {
  const std::string json = read(tokenizer_path());
  for (auto _ : state) {
    const Tokenizer tok = Tokenizer::from_json(json);
    benchmark::DoNotOptimize(tok.encode(text()).data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * text().size());
}
BENCHMARK(BM_EncodeColdCache)->Unit(benchmark::kMillisecond);

void BM_Train(benchmark::State& state) {
  TrainOptions opt;
  opt.vocab_size = state.range(0);
  opt.min_frequency = 2;
  opt.special_tokens = {"<|endoftext|>"};
  for (auto _ : state) benchmark::DoNotOptimize(train_bpe({text()}, opt).vocab_size());
  state.SetBytesProcessed(int64_t(state.iterations()) * text().size());
}
BENCHMARK(BM_Train)->Arg(1000)->Arg(4000)->Unit(benchmark::kMillisecond);

}  // namespace
