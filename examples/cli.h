// What the training examples share on the command line: flag values parsed
// with errors that name the flag (and exit 2 with the usage), durations,
// rank 0's progress line (redrawn in place on a terminal, a line every 10 s
// in a log or pipe, where '\r' would pile up), and main's launch of the
// local workers.
#pragma once

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <string>

#include "core/device.h"
#include "distributed/launch/launch.h"

namespace ember::examples {

// The program's name and usage text, for errors.
struct Cli {
  const char* program;
  const char* usage;

  [[noreturn]] void error(const std::string& msg) const {
    std::fprintf(stderr, "%s: %s\n%s", program, msg.c_str(), usage);
    std::exit(2);
  }
  int64_t parse_int(const std::string& flag, const std::string& v, int64_t min) const {
    char* end = nullptr;
    errno = 0;
    long long x = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || errno == ERANGE) error(flag + " needs an integer, got '" + v + "'");
    if (x < min) error(flag + " must be >= " + std::to_string(min) + ", got " + v);
    return x;
  }
  double parse_positive(const std::string& flag, const std::string& v) const {
    char* end = nullptr;
    double x = std::strtod(v.c_str(), &end);
    if (v.empty() || *end != '\0' || !std::isfinite(x) || x <= 0) error(flag + " needs a positive number, got '" + v + "'");
    return x;
  }
};

// Walks the flags of argv, "--flag value" and "--flag=value" alike; --help
// and -h print the usage and exit 0.
//
//   for (examples::FlagReader r(kCli, argc, argv); r.next();) {
//     if (r.flag() == "--resume") r.no_value(), f.resume = true;
//     else if (r.flag() == "--epochs") f.epochs = kCli.parse_int(r.flag(), r.value(), 1);
//     else kCli.error("unknown flag '" + r.flag() + "'");
//   }
class FlagReader {
 public:
  FlagReader(const Cli& cli, int argc, char** argv) : cli_(cli), argc_(argc), argv_(argv) {}
  bool next() {
    if (++i_ >= argc_) return false;
    flag_ = argv_[i_];
    has_value_ = false;
    if (auto eq = flag_.find('='); flag_.rfind("--", 0) == 0 && eq != std::string::npos) {
      value_ = flag_.substr(eq + 1);
      flag_ = flag_.substr(0, eq);
      has_value_ = true;
    }
    if (flag_ == "--help" || flag_ == "-h") {
      std::fputs(cli_.usage, stdout);
      std::exit(0);
    }
    return true;
  }
  const std::string& flag() const { return flag_; }
  // The flag's value: after '=', else the next argument.
  std::string value() {
    if (has_value_) return value_;
    if (i_ + 1 >= argc_) cli_.error(flag_ + " needs a value");
    return argv_[++i_];
  }
  // For a switch: "--resume=x" is an error.
  void no_value() const {
    if (has_value_) cli_.error(flag_ + " takes no value");
  }

 private:
  const Cli& cli_;
  int argc_;
  char** argv_;
  int i_ = 0;
  std::string flag_, value_;
  bool has_value_ = false;
};

// m:ss, or h:mm:ss from an hour.
inline std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  long t = std::lround(s);
  char buf[32];
  if (t >= 3600) std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
  else std::snprintf(buf, sizeof buf, "%ld:%02ld", t / 60, t % 60);
  return buf;
}

// "epoch 1/2 [=====>    ] 120/468  loss 0.4123  scale 65536  750 img/s  1:23 left" on a
// terminal; "epoch 1/2 step 120/468  loss ..." in a log. `prefix` ("epoch
// 1/2", or "" for steps alone), `unit` ("img/s", "tok/s"), `extra` (shown
// after the loss, e.g. the loss scale).
class Progress {
 public:
  explicit Progress(bool enabled) : enabled_(enabled), tty_(enabled && isatty(STDOUT_FILENO)) {}

  void update(const std::string& prefix, int64_t step, int64_t steps, double loss, double rate, const char* unit,
              double eta_s, bool force = false, const std::string& extra = "") {
    if (!enabled_) return;
    auto now = std::chrono::steady_clock::now();
    if (!force && std::chrono::duration<double>(now - last_).count() < (tty_ ? 0.2 : 10.0)) return;
    last_ = now;
    const std::string lead = prefix.empty() ? "" : prefix + " ";
    char line[320];
    if (tty_) {
      constexpr int kBar = 24;
      int filled = steps > 0 ? static_cast<int>(kBar * step / steps) : 0;
      std::string bar(filled, '=');
      if (filled < kBar) bar.append(1, '>').append(kBar - filled - 1, ' ');
      std::snprintf(line, sizeof line, "\r%s[%s] %lld/%lld  loss %.4f%s  %.0f %s  %s left\x1b[K", lead.c_str(),
                    bar.c_str(), static_cast<long long>(step), static_cast<long long>(steps), loss, extra.c_str(),
                    rate, unit, format_duration(eta_s).c_str());
      open_ = true;
    } else {
      std::snprintf(line, sizeof line, "%sstep %lld/%lld  loss %.4f%s  %.0f %s  %s left\n", lead.c_str(),
                    static_cast<long long>(step), static_cast<long long>(steps), loss, extra.c_str(), rate, unit,
                    format_duration(eta_s).c_str());
    }
    std::fputs(line, stdout);
    std::fflush(stdout);
  }
  // Ends the redrawn line before other output.
  void close_line() {
    if (open_) std::fputs("\n", stdout), std::fflush(stdout);
    open_ = false;
  }

 private:
  bool enabled_, tty_, open_ = false;
  std::chrono::steady_clock::time_point last_{};
};

// The examples' main after their flags are parsed (in the launching
// process, so a typo is reported once): starts `nproc` local workers (0: one
// per GPU, else 2) unless a launcher already named the ranks, runs `train`
// in each, and reports an exception as "<program> [rank N]: message".
inline int launch_and_train(const Cli& cli, int nproc, int argc, char** argv, const std::function<int()>& train) {
  try {
    if (nproc <= 0) nproc = cuda_is_available() ? cuda_device_count() : 2;
    // On a terminal the workers write straight to it (no "[rank N]: "
    // prefixing pipes): rank 0's progress bar redraws its line with '\r'.
    if (int rc = distributed::spawn_local_workers(nproc, argc, argv, /*prefix_output=*/!isatty(STDOUT_FILENO)); rc >= 0)
      return rc;
    return train();
  } catch (const std::exception& e) {
    const char* rank = std::getenv("RANK");
    std::fprintf(stderr, "%s%s: %s\n", cli.program, rank ? (std::string(" [rank ") + rank + "]").c_str() : "", e.what());
    return 1;
  }
}

}  // namespace ember::examples
