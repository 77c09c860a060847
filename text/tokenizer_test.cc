// Byte-level BPE against Hugging Face tokenizers' own output (fixtures in
// text/testdata, written by bench/tokenizer_compare.py --write-fixture),
// hand-checked cases, round trips and every named error of a bad
// tokenizer.json.
#include "text/tokenizer.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "core/exception.h"
#include "text/bpe_trainer.h"
#include "text/byte_level.h"

namespace ember::text {
namespace {

const std::string kData = "text/testdata/";

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EMBER_CHECK(in, "cannot read ", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A tokenizer.json whose ids are easy to check by hand: byte b is token b
// (its GPT-2 character), then merges he, ll, hell, hello, Ġhello (ids 256..)
// and the special token <|endoftext|> as 300.
std::string hand_json() {
  nlohmann::ordered_json vocab;
  for (int b = 0; b < 256; ++b) vocab[bytes_to_token(std::string(1, static_cast<char>(b)))] = b;
  const char* merged[] = {"he", "ll", "hell", "hello", "Ġhello"};
  for (int i = 0; i < 5; ++i) vocab[merged[i]] = 256 + i;
  nlohmann::ordered_json doc = {
      {"version", "1.0"},
      {"added_tokens", {{{"id", 300}, {"content", "<|endoftext|>"}, {"special", true}, {"normalized", false}}}},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model",
       {{"type", "BPE"},
        {"vocab", vocab},
        {"merges", {"h e", "l l", nlohmann::ordered_json::array({"he", "ll"}), "hell o", "Ġ hello"}}}}};
  return doc.dump();
}

TEST(Tokenizer, HandCheckedIds) {
  Tokenizer tok = Tokenizer::from_json(hand_json(), "hand.json");
  // "hello": he (rank 0), ll (1), hell (2), hello (3). " hello": one piece
  // with its space, whose Ġ + hello is rank 4. "!" is byte 33.
  EXPECT_EQ(tok.encode("hello hello!"), (std::vector<int32_t>{259, 260, 33}));
  // Equal ranks merge leftmost first: "lll" is ll + l.
  EXPECT_EQ(tok.encode("lll"), (std::vector<int32_t>{257, 'l'}));
  // The special token is split off before pre-tokenization.
  EXPECT_EQ(tok.encode("hi<|endoftext|>hello"), (std::vector<int32_t>{'h', 'i', 300, 259}));
  EXPECT_EQ(tok.encode("<|endoftext|"),
            (std::vector<int32_t>{'<', '|', 'e', 'n', 'd', 'o', 'f', 't', 'e', 'x', 't', '|'}));
  // GPT-2's regex: "  x" is " " then " x"; a trailing run stays whole.
  EXPECT_EQ(tok.encode("  x  "), (std::vector<int32_t>{' ', ' ', 'x', ' ', ' '}));
  EXPECT_EQ(tok.decode(tok.encode("hi<|endoftext|>hello")), "hi<|endoftext|>hello");
  EXPECT_EQ(tok.decode(std::vector<int32_t>{300, 259}, /*skip_special_tokens=*/true), "hello");
  EXPECT_EQ(tok.token_to_id("<|endoftext|>"), 300);
  EXPECT_EQ(tok.token_to_id("Ġhello"), 260);
  EXPECT_EQ(tok.token_to_id("nope"), std::nullopt);
  EXPECT_EQ(tok.vocab_size(), 301);
  EXPECT_EQ(tok.encode(""), std::vector<int32_t>{});
}

TEST(Tokenizer, IdsEqualHuggingFace) {
  const std::string sample = read(kData + "sample.txt");
  const auto expected = nlohmann::json::parse(read(kData + "sample_ids.json"))["ids"];
  ASSERT_EQ(expected.size(), 3u);
  for (const auto& [file, ids] : expected.items()) {
    SCOPED_TRACE(file);
    Tokenizer tok = Tokenizer::from_file(kData + file);
    const std::vector<int32_t> ours = tok.encode(sample);
    const auto theirs = ids.get<std::vector<int32_t>>();
    ASSERT_EQ(ours.size(), theirs.size());
    for (size_t i = 0; i < ours.size(); ++i) ASSERT_EQ(ours[i], theirs[i]) << "at token " << i;
    // (add_prefix_space adds a space before each run between added tokens.)
    if (file.find("prefix") == std::string::npos) EXPECT_TRUE(tok.decode(ours) == sample);
  }
}

TEST(Tokenizer, RoundTripRandomUtf8) {
  std::mt19937 rng(5);
  // (Not the add_prefix_space variant: it adds a space to the text.)
  for (const char* file : {"hf_bpe.json", "hf_bpe_llama3.json"}) {
    Tokenizer tok = Tokenizer::from_file(kData + file);
    for (int t = 0; t < 200; ++t) {
      std::string s;
      const int n = rng() % 200;
      for (int i = 0; i < n; ++i) {
        uint32_t cp;
        switch (rng() % 4) {
          case 0:
            cp = rng() % 0x80;
            break;
          case 1:
            cp = " \t\n\r'"[rng() % 5];
            break;
          case 2:
            cp = rng() % 0x3000;
            break;
          default:
            cp = rng() % 0x110000;
            break;
        }
        if (cp == 0 || (cp >= 0xD800 && cp <= 0xDFFF)) cp = 'x';
        append_utf8(cp, s);
      }
      ASSERT_EQ(tok.decode(tok.encode(s)), s);
    }
  }
}

// The scan (short words) and the heap (long ones) are the same algorithm.
TEST(BpeModel, ScanEqualsHeap) {
  Tokenizer tok = Tokenizer::from_file(kData + "hf_bpe.json");
  const std::string corpus = read(kData + "corpus.txt");
  std::mt19937 rng(3);
  for (int t = 0; t < 2000; ++t) {
    const size_t len = 2 + rng() % 46, at = rng() % (corpus.size() - len);
    std::vector<int32_t> a;
    for (unsigned char c : corpus.substr(at, len)) a.push_back(*tok.token_to_id(bytes_to_token(std::string(1, c))));
    std::vector<int32_t> b = a;
    tok.model().merge_symbols_scan(a);
    tok.model().merge_symbols_heap(b);
    ASSERT_EQ(a, b) << "at " << at << " len " << len;
  }
}

std::vector<std::pair<std::string, std::string>> merges_of(const nlohmann::json& doc) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& m : doc["model"]["merges"]) {
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      out.emplace_back(s.substr(0, s.find(' ')), s.substr(s.find(' ') + 1));
    } else {
      out.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    }
  }
  return out;
}

TEST(BpeTrainer, MergesEqualHuggingFace) {
  // hf_bpe.json is Hugging Face's BpeTrainer on corpus.txt: vocab_size 800,
  // min_frequency 2, these special tokens, ByteLevel's alphabet.
  TrainOptions opt;
  opt.vocab_size = 800;
  opt.min_frequency = 2;
  opt.special_tokens = {"<|endoftext|>", "<|pad|>"};
  BpeTrainer trainer(opt);
  trainer.feed_file(kData + "corpus.txt");
  const Tokenizer ours = trainer.train();
  const auto theirs = nlohmann::json::parse(read(kData + "hf_bpe.json"));
  const auto mine = nlohmann::json::parse(ours.to_json());
  EXPECT_EQ(merges_of(mine), merges_of(theirs));
  EXPECT_EQ(mine["model"]["vocab"], theirs["model"]["vocab"]);
  EXPECT_EQ(mine["added_tokens"], theirs["added_tokens"]);
  // And it encodes as the file it equals.
  const std::string sample = read(kData + "sample.txt");
  EXPECT_EQ(ours.encode(sample), Tokenizer::from_file(kData + "hf_bpe.json").encode(sample));
}

TEST(BpeTrainer, SmallCorpusByHand) {
  // Words "aaab" x2 and "ab" x3 (no spaces, so each line is one word):
  // pair counts a a: 4, a b: 5 -> "ab" first; then a a: 4 -> "aa"; then
  // aa ab: 2 -> "aaab"; stop at 4 merges or when nothing is left.
  TrainOptions opt;
  opt.vocab_size = 1000;
  opt.max_merges = 4;
  const Tokenizer tok = train_bpe({"aaab\n", "aaab\n", "ab\n", "ab\n", "ab\n"}, opt);
  const auto doc = nlohmann::json::parse(tok.to_json());
  const std::vector<std::pair<std::string, std::string>> expect = {{"a", "b"}, {"a", "a"}, {"aa", "ab"}};
  EXPECT_EQ(merges_of(doc), expect);
  EXPECT_EQ(tok.vocab_size(), 256 + 3);
  // The first ids are the byte characters in code point order: '!' is 0.
  EXPECT_EQ(tok.token_to_id("!"), 0);
  EXPECT_EQ(tok.encode("aaab ab"),
            (std::vector<int32_t>{*tok.token_to_id("aaab"), *tok.token_to_id("Ġ"), *tok.token_to_id("ab")}));
  // min_frequency: nothing is seen 6 times.
  opt.min_frequency = 6;
  EXPECT_EQ(
      nlohmann::json::parse(train_bpe({"aaab\n", "aaab\n", "ab\n", "ab\n", "ab\n"}, opt).to_json())["model"]["merges"]
          .size(),
      0u);
}

TEST(Tokenizer, SaveLoad) {
  TrainOptions opt;
  opt.vocab_size = 400;
  opt.special_tokens = {"<|endoftext|>"};
  const Tokenizer tok = train_bpe({read(kData + "corpus.txt")}, opt);
  const std::string path = testing::TempDir() + "/saved_tokenizer.json";
  tok.save(path);
  const Tokenizer back = Tokenizer::from_file(path);
  const std::string sample = read(kData + "sample.txt");
  EXPECT_EQ(back.encode(sample), tok.encode(sample));
  EXPECT_EQ(back.vocab_size(), 400);
}

// docs/text.md's example, line for line (//docs:snippets_match_test).
TEST(Docs, TextMdExample) {
  const std::string path = testing::TempDir() + "/docs_tokenizer.json";
  const Tokenizer tok = Tokenizer::from_file("text/testdata/hf_bpe.json");
  const std::vector<int32_t> ids = tok.encode("Hello world<|endoftext|>");
  EXPECT_EQ(tok.decode(ids), "Hello world<|endoftext|>");
  BpeTrainer trainer(TrainOptions{.vocab_size = 800, .min_frequency = 2, .special_tokens = {"<|endoftext|>"}});
  trainer.feed_file("text/testdata/corpus.txt");
  const Tokenizer trained = trainer.train();  // equals Hugging Face's BpeTrainer on the same file
  trained.save(path);                         // a tokenizer.json that tokenizers.Tokenizer.from_file loads
  EXPECT_EQ(Tokenizer::from_file(path).encode("Hello world<|endoftext|>"), trained.encode("Hello world<|endoftext|>"));
}

// ---- named errors

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::string edited(const std::function<void(nlohmann::json&)>& edit) {
  auto doc = nlohmann::json::parse(read(kData + "hf_bpe.json"));
  edit(doc);
  return doc.dump();
}

std::string load_error(const std::function<void(nlohmann::json&)>& edit) {
  return error_of([&] { Tokenizer::from_json(edited(edit), "bad.json"); });
}

TEST(TokenizerErrors, OtherModelTypes) {
  for (const char* type : {"WordPiece", "Unigram", "WordLevel"}) {
    const std::string e = load_error([&](nlohmann::json& d) { d["model"]["type"] = type; });
    EXPECT_NE(e.find("bad.json: model.type: '" + std::string(type) + "' is not supported; only BPE is supported"),
              std::string::npos)
        << e;
  }
  EXPECT_NE(load_error([](nlohmann::json& d) { d["model"].erase("type"); }).find("bad.json: model.type: missing"),
            std::string::npos);
}

TEST(TokenizerErrors, MergeTokenNotInVocab) {
  std::string e = load_error([](nlohmann::json& d) { d["model"]["merges"][3] = {"zzqq", "x"}; });
  EXPECT_NE(e.find("bad.json: model.merges[3]: token 'zzqq' is not in model.vocab"), std::string::npos) << e;
  // Both tokens present but not their concatenation.
  e = load_error([](nlohmann::json& d) { d["model"]["merges"][0] = {"!", "!"}; });
  EXPECT_NE(e.find("model.merges[0]: token '!!' is not in model.vocab (merge '!' + '!')"), std::string::npos) << e;
  e = load_error([](nlohmann::json& d) { d["model"]["merges"][1] = "a b c"; });
  EXPECT_NE(e.find("model.merges[1]: 'a b c' is not two tokens separated by one space"), std::string::npos) << e;
  e = load_error([](nlohmann::json& d) { d["model"]["merges"][2] = 7; });
  EXPECT_NE(e.find("model.merges[2]: 7 is neither"), std::string::npos) << e;
}

TEST(TokenizerErrors, UnsupportedPipelineParts) {
  std::string e = load_error([](nlohmann::json& d) { d["normalizer"] = {{"type", "NFC"}}; });
  EXPECT_NE(e.find("bad.json: normalizer: type \"NFC\" is not supported; only null"), std::string::npos) << e;
  e = load_error([](nlohmann::json& d) { d["pre_tokenizer"] = {{"type", "Whitespace"}}; });
  EXPECT_NE(e.find("bad.json: pre_tokenizer.type: 'Whitespace' is not supported; supported: ByteLevel"),
            std::string::npos)
      << e;
  e = load_error([](nlohmann::json& d) {
    d["pre_tokenizer"] = {{"type", "Sequence"},
                          {"pretokenizers",
                           {{{"type", "Split"}, {"pattern", {{"Regex", "\\s+"}}}, {"behavior", "Removed"}},
                            {{"type", "ByteLevel"}, {"use_regex", false}}}}};
  });
  EXPECT_NE(e.find("pre_tokenizer.pretokenizers[0].behavior: \"Removed\" is not supported; only \"Isolated\""),
            std::string::npos)
      << e;
  e = load_error([](nlohmann::json& d) {
    d["pre_tokenizer"] = {{"type", "Sequence"},
                          {"pretokenizers",
                           {{{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}},
                            {{"type", "ByteLevel"}}}}};
  });
  EXPECT_NE(e.find("pre_tokenizer.pretokenizers[0].pattern.Regex: regex '(unclosed'"), std::string::npos) << e;
  e = load_error([](nlohmann::json& d) { d["pre_tokenizer"] = nullptr; });
  EXPECT_NE(e.find("bad.json: pre_tokenizer: missing"), std::string::npos) << e;
  e = load_error([](nlohmann::json& d) { d["decoder"] = {{"type", "WordPiece"}}; });
  EXPECT_NE(e.find("bad.json: decoder.type: 'WordPiece' is not supported; only ByteLevel"), std::string::npos) << e;
  e = load_error([](nlohmann::json& d) { d["model"]["dropout"] = 0.1; });
  EXPECT_NE(e.find("bad.json: model.dropout: 0.1 is not supported"), std::string::npos) << e;
  e = load_error([](nlohmann::json& d) { d["model"]["unk_token"] = "<unk>"; });
  EXPECT_NE(e.find("bad.json: model.unk_token: '<unk>' is not in model.vocab"), std::string::npos) << e;
  e = load_error([](nlohmann::json& d) { d["model"]["continuing_subword_prefix"] = "##"; });
  EXPECT_NE(e.find("model.continuing_subword_prefix: \"##\" is not supported"), std::string::npos) << e;
  e = load_error([](nlohmann::json& d) { d["added_tokens"][0].erase("id"); });
  EXPECT_NE(e.find("bad.json: added_tokens[0].id: must be an integer"), std::string::npos) << e;
  e = load_error([](nlohmann::json& d) { d["model"]["vocab"]["!"] = -4; });
  EXPECT_NE(e.find("bad.json: model.vocab: token '!' has id -4"), std::string::npos) << e;
}

TEST(TokenizerErrors, FilesAndText) {
  EXPECT_NE(error_of([] {
              Tokenizer::from_file("/nonexistent/t.json");
            }).find("/nonexistent/t.json: cannot open the tokenizer file"),
            std::string::npos);
  EXPECT_NE(error_of([] { Tokenizer::from_json("{\"model\": ", "trunc.json"); }).find("trunc.json: not valid JSON"),
            std::string::npos);
  Tokenizer tok = Tokenizer::from_file(kData + "hf_bpe.json");
  EXPECT_NE(error_of([&] { tok.encode("abc\xff"); }).find("encode: the text is not valid UTF-8 at byte 3"),
            std::string::npos);
  EXPECT_NE(error_of([&] { tok.encode("ab\xed\xa0\x80"); }).find("not valid UTF-8 at byte 2"),
            std::string::npos);  // a surrogate
  EXPECT_NE(error_of([&] {
              tok.decode(std::vector<int32_t>{1, 5000});
            }).find("decode: ids[1] = 5000 is not in the vocabulary (800 ids)"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              train_bpe({"ok\n", "bad \xc3"}, TrainOptions{});
            }).find("train: the text is not valid UTF-8"),
            std::string::npos);
}

TEST(Utf8, Validation) {
  EXPECT_EQ(find_invalid_utf8("plain ascii text, long enough to take the 8-byte path"), std::string::npos);
  EXPECT_EQ(find_invalid_utf8("\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80"), std::string::npos);
  EXPECT_EQ(find_invalid_utf8("\xc0\x80"), 0u);             // overlong
  EXPECT_EQ(find_invalid_utf8("ab\xe0\x80\x80"), 2u);       // overlong 3-byte
  EXPECT_EQ(find_invalid_utf8("abc\xf4\x90\x80\x80"), 3u);  // past U+10FFFF
  EXPECT_EQ(find_invalid_utf8("abcdefghij\xe2\x82"), 10u);  // cut short
}

}  // namespace
}  // namespace ember::text
