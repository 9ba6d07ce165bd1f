// Checkpoints: see checkpoint.h for the layout, how the snapshot is taken and what is checked.
#include "baton/graph/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <optional>
#include <regex>
#include <sstream>

#include <boost/json.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <zlib.h>

#include "baton/graph/safetensors.h"
#include "baton/graph/sharding.h"

namespace baton::checkpoint {

namespace fs = std::filesystem;

namespace {

constexpr const char* format_name = "baton.checkpoint";
// 2: step directories may carry assets (Settings::assets, the index's "assets"). Version 1
// checkpoints are read as before.
constexpr int format_version = 2;
constexpr int oldest_version = 1;
constexpr const char* index_name = "index.json";
constexpr char slot_separator = '#';   // "fc0.w#exp_avg": no DSL name uses it
constexpr char piece_separator = '@';  // "fc0.w@0:96": elements [0, 96) of fc0.w (ZeRO's shards)

/// The tensor name of a snapshot part in a file: the variable's, or its piece's.
std::string key_of(const std::string& name, std::int64_t begin, std::int64_t end) {
  return end < 0 ? name : fmt::format("{}{}{}:{}", name, piece_separator, begin, end);
}

[[noreturn]] void fail(const fs::path& path, const std::string& what) {
  throw std::runtime_error(fmt::format("{}: {}", path.string(), what));
}

std::string file_of_rank(std::uint32_t rank) { return fmt::format("rank{}.safetensors", rank); }

/// fsync on a directory makes the renames in it durable (POSIX leaves them in the cache).
void sync_dir(const fs::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail(dir, fmt::format("cannot open the directory to sync it: {}", std::strerror(errno)));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) fail(dir, fmt::format("cannot sync the directory: {}", std::strerror(err)));
}

void write_text(const fs::path& path, const std::string& text) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(path, fmt::format("cannot create: {}", std::strerror(errno)));
  std::size_t done = 0;
  while (done < text.size()) {
    ssize_t w = ::write(fd, text.data() + done, text.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const int err = errno;
      ::close(fd);
      fail(path, fmt::format("cannot write: {}", std::strerror(err)));
    }
    done += static_cast<std::size_t>(w);
  }
  const bool synced = ::fsync(fd) == 0;
  const int err = errno;
  if (::close(fd) != 0 || !synced) fail(path, fmt::format("cannot write: {}", std::strerror(synced ? errno : err)));
}

/// Renames `from` to `to`, replacing a file (or, for directories, an old checkpoint of the same
/// step from an earlier run).
void publish(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  if (fs::is_directory(from) && fs::exists(to)) fs::remove_all(to, ec);
  fs::rename(from, to, ec);
  if (ec) fail(to, fmt::format("cannot rename {} to it: {}", from.string(), ec.message()));
}

/// zlib's CRC-32 (several GB/s; Boost's table-driven one is a tenth of that, which showed in the
/// time a checkpoint takes) over the tensors' bytes in file order.
std::uint32_t crc_of(const std::vector<std::pair<std::string, Tensor>>& tensors) {
  uLong crc = ::crc32_z(0L, Z_NULL, 0);
  for (const auto& [name, t] : tensors) {
    if (t.nbytes() > 0) crc = ::crc32_z(crc, static_cast<const Bytef*>(t.raw()), t.nbytes());
  }
  return static_cast<std::uint32_t>(crc);
}

/// The step of a directory called "step-<digits>" (nothing else: "step-10.tmp-42" is a leftover).
std::optional<std::int64_t> step_of_name(const std::string& name) {
  if (!name.starts_with("step-") || name.size() == 5) return std::nullopt;
  std::int64_t step = 0;
  const char* first = name.data() + 5;
  const char* last = name.data() + name.size();
  auto [end, ec] = std::from_chars(first, last, step);
  if (ec != std::errc() || end != last || step < 0) return std::nullopt;
  return step;
}

boost::json::value parse_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, "cannot read it");
  std::stringstream text;
  text << in.rdbuf();
  boost::system::error_code ec;
  boost::json::value v = boost::json::parse(text.str(), ec);
  if (ec) fail(path, fmt::format("not valid JSON ({})", ec.message()));
  if (!v.is_object()) fail(path, "not a JSON object");
  return v;
}

/// Elements [begin, end) of a variable (of `shape` whole), held by `file` as a 1-D tensor.
struct Piece {
  std::string variable;
  std::int64_t begin = 0, end = 0;
  Shape shape;
  std::string file;
};

struct Index {
  std::int64_t step = 0;
  Layout layout;
  std::string optimizer;
  std::vector<std::string> slots;
  std::string run;
  std::map<std::string, std::string> config;
  std::map<std::string, std::uint32_t> files;  // file -> rank
  std::map<std::string, std::string> file_of;   // variable -> file (those saved whole)
  std::vector<Piece> pieces;                    // the variables saved in pieces
  std::map<std::string, std::pair<std::uint64_t, std::string>> assets;  // name -> (bytes, crc32)
};

/// Reads index.json of a step directory, checking its shape (not yet the files it lists).
Index read_index(const fs::path& dir) {
  const fs::path path = dir / index_name;
  if (!fs::exists(path)) fail(path, "missing: not a complete checkpoint");
  boost::json::value v = parse_file(path);
  const boost::json::object& o = v.as_object();
  auto need = [&](const char* key) -> const boost::json::value& {
    const boost::json::value* x = o.if_contains(key);
    if (x == nullptr) fail(path, fmt::format("no \"{}\"", key));
    return *x;
  };
  auto integer = [&](const boost::json::value& x, const std::string& what) -> std::int64_t {
    if (x.is_int64()) return x.get_int64();
    if (x.is_uint64() && x.get_uint64() <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      return static_cast<std::int64_t>(x.get_uint64());
    }
    fail(path, fmt::format("\"{}\" is not an integer", what));
  };
  auto string = [&](const boost::json::value& x, const std::string& what) -> std::string {
    if (!x.is_string()) fail(path, fmt::format("\"{}\" is not a string", what));
    return std::string(x.as_string());
  };
  if (!need("format").is_string() || need("format").as_string() != format_name) {
    fail(path, fmt::format("\"format\" is not \"{}\": not a baton checkpoint", format_name));
  }
  const std::int64_t version = integer(need("version"), "version");
  if (version < oldest_version || version > format_version) {
    fail(path, fmt::format("version {} (this baton reads versions {} to {})", version, oldest_version, format_version));
  }
  Index ix;
  ix.step = integer(need("step"), "step");
  if (ix.step < 1) fail(path, fmt::format("step {} is not a step after training began", ix.step));
  if (dir.filename().string() != step_dir("", ix.step).string() && step_of_name(dir.filename().string())) {
    fail(path, fmt::format("says step {} but lies in {}", ix.step, dir.filename().string()));
  }
  if (!need("layout").is_object()) fail(path, "\"layout\" is not an object");
  const auto& lo = need("layout").as_object();
  for (auto [key, field] : {std::pair{"dp", &Layout::dp}, {"pp", &Layout::pp}, {"tp", &Layout::tp}, {"ranks", &Layout::ranks}}) {
    const boost::json::value* x = lo.if_contains(key);
    if (x == nullptr) fail(path, fmt::format("\"layout\" has no \"{}\"", key));
    const std::int64_t n = integer(*x, fmt::format("layout.{}", key));
    if (n < 1 || n > 65536) fail(path, fmt::format("layout.{} is {}", key, n));
    ix.layout.*field = static_cast<int>(n);
  }
  if (!need("optimizer").is_object()) fail(path, "\"optimizer\" is not an object");
  const auto& opt = need("optimizer").as_object();
  if (!opt.contains("kind") || !opt.contains("slots") || !opt.at("slots").is_array()) {
    fail(path, "\"optimizer\" needs \"kind\" and a \"slots\" list");
  }
  ix.optimizer = string(opt.at("kind"), "optimizer.kind");
  for (const auto& s : opt.at("slots").as_array()) ix.slots.push_back(string(s, "optimizer.slots"));
  ix.run = string(need("run"), "run");
  if (!need("config").is_object()) fail(path, "\"config\" is not an object");
  for (const auto& [k, x] : need("config").as_object()) ix.config[std::string(k)] = string(x, fmt::format("config.{}", std::string(k)));
  if (const boost::json::value* assets = o.if_contains("assets")) {
    if (!assets->is_object()) fail(path, "\"assets\" is not an object");
    for (const auto& [k, x] : assets->as_object()) {
      const std::string file(k);
      if (file.empty() || file.find('/') != std::string::npos || file == "." || file == ".." || !x.is_object() ||
          !x.as_object().contains("bytes") || !x.as_object().contains("crc32")) {
        fail(path, fmt::format("\"assets\" has a bad entry '{}'", file));
      }
      ix.assets[file] = {static_cast<std::uint64_t>(integer(x.as_object().at("bytes"), "assets.bytes")),
                         string(x.as_object().at("crc32"), "assets.crc32")};
    }
  }
  if (!need("files").is_object() || need("files").as_object().empty()) fail(path, "\"files\" lists no files");
  for (const auto& [k, x] : need("files").as_object()) {
    const std::string file(k);
    // Only plain names: a file list must not reach outside its directory.
    if (file.empty() || file.find('/') != std::string::npos || file == "." || file == ".." || !x.is_object()) {
      fail(path, fmt::format("\"files\" has a bad entry '{}'", file));
    }
    const auto& fo = x.as_object();
    if (!fo.contains("rank") || !fo.contains("variables") || !fo.at("variables").is_array()) {
      fail(path, fmt::format("\"files\".\"{}\" needs \"rank\" and a \"variables\" list", file));
    }
    ix.files[file] = static_cast<std::uint32_t>(integer(fo.at("rank"), "rank"));
    for (const auto& var : fo.at("variables").as_array()) {
      const std::string name = string(var, "variables");
      if (!ix.file_of.emplace(name, file).second) {
        fail(path, fmt::format("variable '{}' is listed in {} and in {}", name, ix.file_of[name], file));
      }
    }
    if (!fo.contains("pieces")) continue;
    if (!fo.at("pieces").is_array()) fail(path, fmt::format("\"files\".\"{}\".\"pieces\" is not a list", file));
    for (const auto& entry : fo.at("pieces").as_array()) {
      const boost::json::object* piece = entry.if_object();
      if (piece == nullptr || !piece->contains("variable") || !piece->contains("begin") || !piece->contains("end") ||
          !piece->contains("shape") || !piece->at("shape").is_array()) {
        fail(path, fmt::format("a piece in \"files\".\"{}\" needs \"variable\", \"begin\", \"end\" and a \"shape\" list", file));
      }
      const auto& po = *piece;
      Piece p{.variable = string(po.at("variable"), "variable"),
              .begin = integer(po.at("begin"), "begin"),
              .end = integer(po.at("end"), "end"),
              .file = file};
      for (const auto& d : po.at("shape").as_array()) {
        const std::int64_t n = integer(d, "shape");
        if (n < 0) fail(path, fmt::format("piece of '{}': a negative dimension", p.variable));
        p.shape.push_back(n);
      }
      if (p.begin < 0 || p.begin >= p.end || p.end > numel(p.shape)) {
        fail(path, fmt::format("piece [{}, {}) of '{}' lies outside its {} elements", p.begin, p.end, p.variable,
                               numel(p.shape)));
      }
      ix.pieces.push_back(std::move(p));
    }
  }
  for (const Piece& p : ix.pieces) {
    if (ix.file_of.count(p.variable)) {
      fail(path, fmt::format("variable '{}' is listed whole in {} and in pieces in {}", p.variable,
                             ix.file_of.at(p.variable), p.file));
    }
  }
  return ix;
}

/// The listed files that are missing (a checkpoint of several ranks whose writing was cut short).
std::vector<std::string> missing_files(const fs::path& dir, const Index& ix) {
  std::vector<std::string> missing;
  for (const auto& [file, rank] : ix.files) {
    if (!fs::exists(dir / file)) missing.push_back(file);
  }
  return missing;
}

}  // namespace

fs::path step_dir(const fs::path& dir, std::int64_t step) { return dir / fmt::format("step-{:08}", step); }

namespace {

/// index.json of step `step`: the layout, optimizer, settings, data position and RNG, and which
/// file holds which variables (and pieces).
std::string index_json(const Settings& settings, const std::vector<SnapshotPart>& all, const std::string& run,
                       std::int64_t step) {
  boost::json::object index;
  index["format"] = format_name;
  index["version"] = format_version;
  index["step"] = step;
  const Layout& l = settings.layout;
  index["layout"] = {{"dp", l.dp}, {"pp", l.pp}, {"tp", l.tp}, {"ranks", l.ranks}};
  boost::json::array slot_names;
  for (const std::string& s : optimizer_slot_names(settings.optimizer)) slot_names.push_back(boost::json::string(s));
  index["optimizer"] = {{"kind", name(settings.optimizer.kind)}, {"slots", std::move(slot_names)}};
  index["run"] = run;
  boost::json::object config;
  for (const auto& [k, v] : settings.config) config[k] = v;
  index["config"] = std::move(config);
  if (!settings.assets.empty()) {
    boost::json::object assets;
    for (const auto& [name, bytes] : settings.assets) {
      const auto crc = ::crc32(0L, reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(bytes.size()));
      assets[name] = {{"bytes", bytes.size()}, {"crc32", fmt::format("{:08x}", crc)}};
    }
    index["assets"] = std::move(assets);
  }
  index["data_position"] = {{"steps_done", step},
                            {"next_step", step + 1},
                            {"samples_seen", step * settings.batch},
                            {"how", "step s reads the rows of the data's stream that every run reads at step s"}};
  index["rng"] = {{"seed", settings.seed},
                  {"how", "data order, text windows and dropout are functions of (seed, step, piece); a resumed run "
                          "draws from step + 1 on"}};
  std::map<std::uint32_t, std::vector<const SnapshotPart*>> by_rank;
  for (const SnapshotPart& p : all) by_rank[p.rank].push_back(&p);
  boost::json::object files;
  for (const auto& [rank, parts] : by_rank) {
    boost::json::array names, pieces;
    for (const SnapshotPart* p : parts) {
      if (p->whole()) {
        names.push_back(boost::json::string(p->name));
        continue;
      }
      boost::json::array shape;
      for (std::int64_t d : p->shape) shape.push_back(d);
      pieces.push_back({{"variable", p->name}, {"begin", p->begin}, {"end", p->end}, {"shape", std::move(shape)}});
    }
    boost::json::object file{{"rank", rank}, {"variables", std::move(names)}};
    if (!pieces.empty()) file["pieces"] = std::move(pieces);  // ZeRO's shards (absent otherwise)
    files[file_of_rank(rank)] = std::move(file);
  }
  index["files"] = std::move(files);
  return boost::json::serialize(index) + "\n";
}

}  // namespace

Writer::Writer(Settings settings) : settings_(std::move(settings)) {
  if (settings_.dir.empty()) throw std::invalid_argument("checkpoint::Writer: no directory");
  if (settings_.keep < 1) throw std::invalid_argument(fmt::format("checkpoints to keep: {} (at least 1)", settings_.keep));
  if (settings_.max_queued < 1) throw std::invalid_argument(fmt::format("max_queued: {} (at least 1)", settings_.max_queued));
  std::error_code ec;
  fs::create_directories(settings_.dir, ec);
  if (ec || !fs::is_directory(settings_.dir)) {
    fail(settings_.dir, fmt::format("cannot make the checkpoint directory: {}", ec ? ec.message() : "not a directory"));
  }
  thread_ = std::thread([this] { writer_loop(); });
}

Writer::~Writer() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

void Writer::writer_loop() {
  std::unique_lock lock(mutex_);
  for (;;) {
    changed_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and everything is written
    auto [step, snapshots] = std::move(queue_.front());
    queue_.pop_front();
    writing_ = true;
    lock.unlock();
    std::exception_ptr failed;
    try {
      write_step(step, std::move(snapshots));
    } catch (...) {
      failed = std::current_exception();
    }
    lock.lock();
    writing_ = false;
    if (failed && !error_) error_ = failed;
    if (!failed) written_.push_back(step_dir(settings_.dir, step));
    changed_.notify_all();
  }
}

void Writer::finish() {
  std::unique_lock lock(mutex_);
  // No deadline of its own: each write is bounded by the disk; take() bounds the queue.
  changed_.wait(lock, [&] { return (queue_.empty() && !writing_) || error_; });
  if (error_) std::rethrow_exception(error_);
}

void Writer::expect(const std::vector<SnapshotPart>& parts) {
  std::lock_guard lock(mutex_);
  parts_ = parts;
  rank_of_.clear();
  mine_ = 0;
  std::uint32_t lowest = std::numeric_limits<std::uint32_t>::max();
  for (const SnapshotPart& p : parts_) {
    for (char c : {slot_separator, piece_separator}) {
      if (p.name.find(c) != std::string::npos) {
        throw std::invalid_argument(fmt::format("variable '{}': checkpoints cannot save a name with '{}'", p.name, c));
      }
    }
    if (!rank_of_.emplace(key_of(p.name, p.begin, p.end), p.rank).second) {
      throw std::invalid_argument(fmt::format("checkpoint: '{}' is expected twice", key_of(p.name, p.begin, p.end)));
    }
    if (p.rank == settings_.rank) ++mine_;
    lowest = std::min<std::uint32_t>(lowest, p.rank);
  }
  // The lowest rank that trains weights writes the index (and prunes): it is on every job.
  index_writer_ = lowest == settings_.rank;
}

std::function<void(VariableSnapshot)> Writer::hook() {
  return [self = shared_from_this()](VariableSnapshot s) { self->take(std::move(s)); };
}

void Writer::take(VariableSnapshot snapshot) {
  const std::int64_t step = snapshot.step;
  std::unique_lock lock(mutex_);
  if (error_) std::rethrow_exception(error_);  // an earlier checkpoint failed: so does the job
  const std::string key = key_of(snapshot.name, snapshot.begin, snapshot.end);
  auto it = rank_of_.find(key);
  if (it == rank_of_.end() || it->second != settings_.rank) {
    throw std::logic_error(fmt::format("checkpoint of step {}: variable '{}' is not one this rank trains", step, key));
  }
  auto& got = pending_[step];
  got.push_back(std::move(snapshot));
  if (got.size() < mine_) return;
  std::vector<VariableSnapshot> complete = std::move(got);
  pending_.erase(step);
  // Back-pressure from the disk: a full queue holds the actor (and so the stream) back.
  const auto room = [&] { return static_cast<int>(queue_.size()) < settings_.max_queued || error_; };
  if (!changed_.wait_for(lock, settings_.disk_timeout, room)) {
    throw std::runtime_error(fmt::format("{}: checkpoint of step {} waited {} s for the writing of {} earlier "
                                         "ones: the disk is too slow or stuck",
                                         settings_.dir.string(), step, settings_.disk_timeout.count(), queue_.size()));
  }
  if (error_) std::rethrow_exception(error_);
  queue_.emplace_back(step, std::move(complete));
  changed_.notify_all();
}

std::vector<fs::path> Writer::written() const {
  std::lock_guard lock(mutex_);
  return written_;
}

void Writer::write_step(std::int64_t step, std::vector<VariableSnapshot> snapshots) {
  std::sort(snapshots.begin(), snapshots.end(),
            [](const auto& a, const auto& b) { return std::tie(a.name, a.begin) < std::tie(b.name, b.begin); });
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (VariableSnapshot& s : snapshots) {
    const std::string key = key_of(s.name, s.begin, s.end);
    tensors.emplace_back(key, s.weight);
    for (const std::string& slot : optimizer_slot_names(settings_.optimizer)) {
      tensors.emplace_back(key + slot_separator + slot, s.slots.at(slot));
    }
  }
  const std::string run = settings_.config.count("run") ? settings_.config.at("run") : std::string();
  const std::map<std::string, std::string> meta{{"format", format_name},
                                                {"version", std::to_string(format_version)},
                                                {"step", std::to_string(step)},
                                                {"rank", std::to_string(settings_.rank)},
                                                {"run", run},
                                                {"optimizer", std::string(name(settings_.optimizer.kind))},
                                                {"crc32", fmt::format("{:08x}", crc_of(tensors))}};
  // The index: the same text on every rank that would write it.
  const std::string index_text = index_json(settings_, parts_, run, step);

  const fs::path final_dir = step_dir(settings_.dir, step);
  const std::string mine = file_of_rank(settings_.rank);
  if (settings_.layout.ranks == 1) {
    // One rank: the whole directory appears at once.
    const fs::path tmp = settings_.dir / fmt::format("{}.tmp-{}", final_dir.filename().string(), ::getpid());
    std::error_code ec;
    fs::remove_all(tmp, ec);
    fs::create_directories(tmp, ec);
    if (ec) fail(tmp, fmt::format("cannot make the directory: {}", ec.message()));
    safetensors::write(tmp / mine, tensors, meta);
    for (const auto& [name, bytes] : settings_.assets) write_text(tmp / name, bytes);
    write_text(tmp / index_name, index_text);
    sync_dir(tmp);
    publish(tmp, final_dir);
    sync_dir(settings_.dir);
  } else {
    // Several ranks: each file appears at once; the index lists what a complete one holds.
    std::error_code ec;
    fs::create_directories(final_dir, ec);
    if (ec) fail(final_dir, fmt::format("cannot make the directory: {}", ec.message()));
    const std::string suffix = fmt::format(".tmp-{}", ::getpid());
    safetensors::write(final_dir / (mine + suffix), tensors, meta);
    publish(final_dir / (mine + suffix), final_dir / mine);
    if (index_writer_) {
      for (const auto& [name, bytes] : settings_.assets) {
        write_text(final_dir / (name + suffix), bytes);
        publish(final_dir / (name + suffix), final_dir / name);
      }
      write_text(final_dir / (index_name + suffix), index_text);
      publish(final_dir / (index_name + suffix), final_dir / index_name);
    }
    sync_dir(final_dir);
  }
  if (!index_writer_) return;
  // Keep the newest `keep` complete checkpoints; remove what is older, complete or not, and
  // the leftovers of crashed writers at or before them.
  std::vector<std::pair<std::int64_t, fs::path>> steps, leftovers;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(settings_.dir, ec)) {
    const std::string n = e.path().filename().string();
    if (auto s = step_of_name(n)) {
      steps.emplace_back(*s, e.path());
    } else if (auto dot = n.find(".tmp-"); dot != std::string::npos) {
      if (auto s2 = step_of_name(n.substr(0, dot))) leftovers.emplace_back(*s2, e.path());
    }
  }
  std::sort(steps.rbegin(), steps.rend());
  int complete = 0;
  std::int64_t oldest_kept = -1;
  for (const auto& [s, path] : steps) {
    if (complete >= settings_.keep) break;
    try {
      if (missing_files(path, read_index(path)).empty()) {
        ++complete;
        oldest_kept = s;
      }
    } catch (const std::runtime_error&) {  // not complete: neither counted nor kept for it
    }
  }
  if (complete < settings_.keep) return;
  for (const auto& [s, path] : steps) {
    if (s < oldest_kept) fs::remove_all(path, ec);
  }
  for (const auto& [s, path] : leftovers) {
    if (s <= step && path.filename().string().find(fmt::format(".tmp-{}", ::getpid())) == std::string::npos) {
      fs::remove_all(path, ec);
    }
  }
}

Found find(const fs::path& dir) {
  if (!fs::is_directory(dir)) fail(dir, "no such checkpoint directory");
  if (fs::exists(dir / index_name)) return {dir, {}};
  std::vector<std::pair<std::int64_t, fs::path>> steps;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (auto s = step_of_name(e.path().filename().string()); s && e.is_directory()) steps.emplace_back(*s, e.path());
  }
  std::sort(steps.rbegin(), steps.rend());
  Found found;
  for (const auto& [s, path] : steps) {
    try {
      const Index ix = read_index(path);
      const auto missing = missing_files(path, ix);
      if (missing.empty()) {
        found.dir = path;
        return found;
      }
      found.skipped.push_back(fmt::format("{}: incomplete, no {}", path.string(), fmt::join(missing, ", ")));
    } catch (const std::runtime_error& e) {
      found.skipped.push_back(e.what());
    }
  }
  fail(dir, found.skipped.empty() ? std::string("holds no checkpoint (no step-N directory)")
                                  : fmt::format("holds no complete checkpoint ({})", fmt::join(found.skipped, "; ")));
}

namespace {

/// Copies piece `p` (and its optimizer slots) from `in_file` into its place in the whole
/// variables of `c`, made at the first piece; erases what it took from `in_file`.
void take_piece(const Piece& p, const fs::path& path, const std::vector<std::string>& slots,
                std::map<std::string, Tensor>& in_file, Checkpoint& c) {
  const std::string key = key_of(p.variable, p.begin, p.end);
  auto place = [&](const std::string& name, Tensor& whole) {
    auto t = in_file.find(name);
    if (t == in_file.end()) fail(path, fmt::format("tensor '{}' is missing (the index lists it here)", name));
    const Tensor& piece = t->second;
    if (piece.shape() != Shape{p.end - p.begin}) {
      fail(path, fmt::format("tensor '{}' is {}, not the {} elements [{}, {})", name, piece.describe(), p.end - p.begin,
                             p.begin, p.end));
    }
    if (!whole.defined()) whole = Tensor::zeros(p.shape, piece.dtype());
    if (whole.dtype() != piece.dtype()) {
      fail(path, fmt::format("tensor '{}' is {} but another piece of '{}' is {}", name, baton::name(piece.dtype()),
                             p.variable, baton::name(whole.dtype())));
    }
    const std::size_t bytes = size_of(piece.dtype());
    std::memcpy(static_cast<char*>(whole.raw()) + static_cast<std::size_t>(p.begin) * bytes, piece.raw(), piece.nbytes());
    in_file.erase(t);
  };
  place(key, c.weights[p.variable]);
  for (const std::string& slot : slots) place(key + slot_separator + slot, c.slots[p.variable][slot]);
}

/// Each variable saved in pieces is covered by them exactly once.
void check_pieces_cover(const Index& ix, const fs::path& index) {
  std::map<std::string, std::vector<std::pair<std::int64_t, std::int64_t>>> ranges;
  std::map<std::string, std::int64_t> sizes;
  for (const Piece& p : ix.pieces) {
    ranges[p.variable].emplace_back(p.begin, p.end);
    auto [it, first] = sizes.emplace(p.variable, numel(p.shape));
    if (!first && it->second != numel(p.shape)) fail(index, fmt::format("the pieces of '{}' disagree on its shape", p.variable));
  }
  for (auto& [var, rs] : ranges) {
    std::sort(rs.begin(), rs.end());
    std::int64_t at = 0;
    for (const auto& [b, e] : rs) {
      if (b != at) {
        fail(index, fmt::format("the pieces of '{}' {} elements [{}, {})", var, b > at ? "leave out" : "overlap at",
                                std::min(at, b), std::max(at, b)));
      }
      at = e;
    }
    if (at != sizes.at(var)) fail(index, fmt::format("the pieces of '{}' end at element {} of {}", var, at, sizes.at(var)));
  }
}

}  // namespace

Checkpoint load(const fs::path& dir) {
  if (!fs::is_directory(dir)) fail(dir, "no such checkpoint directory");
  const Index ix = read_index(dir);
  if (auto missing = missing_files(dir, ix); !missing.empty()) {
    fail(dir / missing[0], "missing: the checkpoint is incomplete (a rank did not finish writing it)");
  }
  Checkpoint c;
  c.dir = dir;
  c.step = ix.step;
  c.layout = ix.layout;
  c.optimizer = ix.optimizer;
  c.config = ix.config;
  for (const auto& [name, want] : ix.assets) {
    const fs::path path = dir / name;
    std::ifstream in(path, std::ios::binary);
    if (!in) fail(path, "missing: the checkpoint's index lists it as an asset");
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto crc = ::crc32(0L, reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(bytes.size()));
    if (bytes.size() != want.first || fmt::format("{:08x}", crc) != want.second) {
      fail(path, fmt::format("{} bytes with CRC-32 {:08x}, but the index says {} bytes with {}: damaged", bytes.size(),
                             crc, want.first, want.second));
    }
    c.assets[name] = path;
  }
  for (const auto& [file, rank] : ix.files) {
    const fs::path path = dir / file;
    safetensors::Contents contents = safetensors::read(path);
    auto meta = [&](const std::string& key) {
      auto it = contents.metadata.find(key);
      if (it == contents.metadata.end()) fail(path, fmt::format("no \"{}\" in its __metadata__: not a baton checkpoint file", key));
      return it->second;
    };
    if (meta("format") != format_name) fail(path, fmt::format("__metadata__ format is '{}', not '{}'", meta("format"), format_name));
    if (meta("step") != std::to_string(ix.step)) {
      fail(path, fmt::format("holds step {} but the index says step {} (a file from another checkpoint)", meta("step"), ix.step));
    }
    if (meta("rank") != std::to_string(rank)) fail(path, fmt::format("was written by rank {}, the index says rank {}", meta("rank"), rank));
    if (meta("version") != std::to_string(format_version) && meta("version") != std::to_string(oldest_version)) {
      fail(path, fmt::format("__metadata__ version is '{}', not {} to {}", meta("version"), oldest_version, format_version));
    }
    if (meta("run") != ix.run) fail(path, "was written by another run than the index (a leftover of an earlier job)");
    if (meta("optimizer") != ix.optimizer) {
      fail(path, fmt::format("holds {} state but the index says {}", meta("optimizer"), ix.optimizer));
    }
    const std::string crc = fmt::format("{:08x}", crc_of(contents.tensors));
    if (meta("crc32") != crc) fail(path, fmt::format("CRC-32 of the data is {} but the file says {}: corrupt", crc, meta("crc32")));
    std::map<std::string, Tensor> in_file(contents.tensors.begin(), contents.tensors.end());
    for (const auto& [var, f] : ix.file_of) {
      if (f != file) continue;
      auto w = in_file.find(var);
      if (w == in_file.end()) fail(path, fmt::format("tensor '{}' is missing (the index lists it here)", var));
      c.weights[var] = w->second;
      in_file.erase(w);
      for (const std::string& slot : ix.slots) {
        const std::string key = var + slot_separator + slot;
        auto t = in_file.find(key);
        if (t == in_file.end()) fail(path, fmt::format("tensor '{}' is missing ({} keeps {})", key, ix.optimizer, slot));
        if (t->second.shape() != c.weights[var].shape() || t->second.dtype() != c.weights[var].dtype()) {
          fail(path, fmt::format("tensor '{}' is {} but its weight is {}", key, t->second.describe(), c.weights[var].describe()));
        }
        c.slots[var][slot] = t->second;
        in_file.erase(t);
      }
    }
    for (const Piece& p : ix.pieces) {
      if (p.file == file) take_piece(p, path, ix.slots, in_file, c);
    }
    if (!in_file.empty()) fail(path, fmt::format("tensor '{}' is not listed in the index", in_file.begin()->first));
  }
  check_pieces_cover(ix, dir / index_name);
  return c;
}

std::vector<std::string> reshard(Checkpoint& c, const ParameterStore& params) {
  const fs::path index = c.dir / index_name;
  // Parts by whole name: k -> the name of part k (-1: whole).
  using Family = std::map<std::int64_t, std::string>;
  std::map<std::string, Family> saved, wanted;
  for (const auto& [name, t] : c.weights) {
    auto [whole, k] = tp_part_name(name);
    saved[whole][k] = name;
  }
  for (const auto& [name, t] : params.values()) {
    auto [whole, k] = tp_part_name(name);
    wanted[whole][k] = name;
  }
  // A family is whole ({-1}) or parts 0 .. n-1.
  auto count = [&](const std::string& whole, const Family& f, const char* where) -> std::int64_t {
    if (f.size() == 1 && f.begin()->first == -1) return 1;
    std::int64_t k = 0;
    for (const auto& [i, name] : f) {
      if (i != k++) {
        std::vector<std::int64_t> ks;
        for (const auto& part : f) ks.push_back(part.first);
        fail(index, fmt::format("weight '{}' is split in {} into parts {}: not parts 0 to {}", whole, where,
                                fmt::join(ks, ", "), f.size() - 1));
      }
    }
    return k;
  };
  std::vector<std::string> changed;
  for (const auto& family : wanted) {
    const std::string& whole = family.first;
    const Family& want = family.second;
    const auto it = saved.find(whole);
    if (it == saved.end()) continue;  // restore() and check_covers() name what is missing
    const Family& have = it->second;
    auto same_parts = [](const Family& a, const Family& b) {
      return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](const auto& x, const auto& y) {
               return x.first == y.first;
             });
    };
    if (same_parts(have, want)) continue;
    const std::int64_t n_have = count(whole, have, "the checkpoint"), n_want = count(whole, want, "the model");
    const Tensor& one_saved = c.weights.at(have.begin()->second);
    const Tensor& one_wanted = params.at(want.begin()->second);
    const Shape &ps = one_saved.shape(), &pw = one_wanted.shape();
    // The axis the parts were cut on: the one where they differ, n_have parts of one as long as
    // n_want of the other.
    std::optional<std::int32_t> axis;
    bool fits = ps.size() == pw.size() && one_saved.dtype() == one_wanted.dtype();
    for (std::size_t a = 0; fits && a < ps.size(); ++a) {
      if (ps[a] == pw[a]) continue;
      if (axis || ps[a] * n_have != pw[a] * n_want) fits = false;
      axis = static_cast<std::int32_t>(a);
    }
    if (!fits || !axis) {
      fail(index, fmt::format("weight '{}' is {} part{} of {}{} in the checkpoint, which {} part{} of {}{} cannot "
                              "make: another model",
                              whole, n_have, n_have == 1 ? "" : "s", baton::name(one_saved.dtype()), to_string(ps),
                              n_want, n_want == 1 ? "" : "s", baton::name(one_wanted.dtype()), to_string(pw)));
    }
    // The weight and each of its slots: joined as saved, cut as wanted.
    auto recut = [&](auto&& tensor_of_saved, auto&& put) {
      std::vector<const Tensor*> parts;
      for (const auto& [k, name] : have) parts.push_back(&tensor_of_saved(name));
      const Tensor joined = concat_along(parts, *axis);
      for (const auto& [k, name] : want)
        put(name, n_want == 1 ? joined : part_along(joined, *axis, static_cast<std::int32_t>(k), static_cast<std::int32_t>(n_want)));
    };
    std::map<std::string, Tensor> weights;
    recut([&](const std::string& n) -> const Tensor& { return c.weights.at(n); },
          [&](const std::string& n, Tensor t) { weights[n] = std::move(t); });
    std::map<std::string, std::map<std::string, Tensor>> slots;
    if (c.slots.count(have.begin()->second)) {
      for (const auto& slot_tensor : c.slots.at(have.begin()->second)) {
        const std::string& slot = slot_tensor.first;
        for (const auto& [k, name] : have) {
          if (!c.slots.count(name) || !c.slots.at(name).count(slot))
            fail(index, fmt::format("has no optimizer slot '{}' for '{}'", slot, name));
        }
        recut([&](const std::string& n) -> const Tensor& { return c.slots.at(n).at(slot); },
              [&](const std::string& n, Tensor part) { slots[n][slot] = std::move(part); });
      }
    }
    for (const auto& [k, name] : have) {
      c.weights.erase(name);
      c.slots.erase(name);
    }
    for (auto& [name, t] : weights) c.weights[name] = std::move(t);
    for (auto& [name, s] : slots) c.slots[name] = std::move(s);
    changed.push_back(fmt::format("{}: {} -> {} along axis {}", whole, n_have == 1 ? "whole" : fmt::format("{} parts", n_have),
                                  n_want == 1 ? "whole" : fmt::format("{} parts", n_want), *axis));
  }
  return changed;
}

void restore(const Checkpoint& c, ParameterStore& params, const OptimizerConfig& optimizer) {
  const fs::path index = c.dir / index_name;
  if (c.optimizer != name(optimizer.kind)) {
    fail(index, fmt::format("written with optimizer {}, but this run uses {}", c.optimizer, name(optimizer.kind)));
  }
  for (const auto& [var, t] : c.weights) {
    if (!params.contains(var)) fail(index, fmt::format("holds weight '{}', which the model does not have: another model", var));
    const Tensor& now = params.at(var);
    if (now.shape() != t.shape() || now.dtype() != t.dtype()) {
      fail(index, fmt::format("weight '{}' is {}{} in the checkpoint but {}{} in the model", var, baton::name(t.dtype()),
                              to_string(t.shape()), baton::name(now.dtype()), to_string(now.shape())));
    }
  }
  const auto slots = optimizer_slot_names(optimizer);
  for (const auto& [var, t] : c.weights) {
    for (const std::string& s : slots) {
      if (!c.slots.count(var) || !c.slots.at(var).count(s)) {
        fail(index, fmt::format("has no optimizer slot '{}' for '{}' (written with {} momentum 0?)", s, var, c.optimizer));
      }
    }
  }
  for (const auto& [var, t] : c.weights) params.set(var, t);
}

void check_covers(const Checkpoint& c, const std::map<std::string, Placement>& trained) {
  for (const auto& [var, where] : trained) {
    if (!c.weights.count(var)) {
      fail(c.dir / index_name, fmt::format("has no weight '{}', which this model trains: another model", var));
    }
  }
}

std::vector<std::string> mismatches(const Checkpoint& c, const std::map<std::string, std::string>& config,
                                    const std::vector<std::string>& keys) {
  std::vector<std::string> out;
  for (const std::string& k : keys) {
    auto a = c.config.find(k);
    auto b = config.find(k);
    const std::string was = a == c.config.end() ? "(none)" : a->second;
    const std::string now = b == config.end() ? "(none)" : b->second;
    if (was != now) out.push_back(fmt::format("{}: checkpoint {}, this run {}", k, was, now));
  }
  return out;
}

}  // namespace baton::checkpoint
