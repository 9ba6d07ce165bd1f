// The dashboard in a real browser: headless Chromium opens the page of a live baton-train run
// and the test reads the DOM through the DevTools protocol: the actor table lists every actor
// of the plan with a non-zero rate, the graph has a node per actor, the charts and the pipeline
// timeline have drawn. A screenshot lands in build/test-artifacts/dashboard.png.
//
// Where Chromium is not installed or cannot start, the test skips (test::skip: exit 77, which
// CTest reports as skipped; a failure under CI=true). scripts/run.sh installs Debian's chromium.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include <boost/json.hpp>

#include "browser/cdp.h"
#include "http_client.h"
#include "mp/proc.h"
#include "skip.h"

namespace fs = std::filesystem;
namespace json = boost::json;
using namespace std::chrono_literals;
using baton::test::Proc;

namespace {

std::optional<std::string> find_chromium() {
  if (const char* given = std::getenv("BATON_CHROMIUM"); given != nullptr && *given != '\0') return std::string(given);
  const char* path = std::getenv("PATH");
  if (path == nullptr) return std::nullopt;
  for (const char* name : {"chromium", "chromium-browser", "google-chrome", "google-chrome-stable"}) {
    std::string dirs = path;
    std::size_t start = 0;
    while (start <= dirs.size()) {
      const std::size_t end = std::min(dirs.find(':', start), dirs.size());
      const fs::path candidate = fs::path(dirs.substr(start, end - start)) / name;
      if (::access(candidate.c_str(), X_OK) == 0) return candidate.string();
      start = end + 1;
    }
  }
  return std::nullopt;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string tail(const std::string& text, std::size_t n = 1500) {
  return text.size() <= n ? text : text.substr(text.size() - n);
}

/// A fresh temporary directory, removed when this goes.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "baton-browser-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

/// What the page shows, as read from its DOM.
constexpr const char* probe_js = R"JS((() => {
  const rows = [...document.querySelectorAll('#actor-table tbody tr')].map(r => [r.dataset.actor, Number(r.dataset.rate)]);
  const nodes = [...document.querySelectorAll('#graph g.node')].map(g => g.dataset.actor);
  const colored = [...document.querySelectorAll('#graph g.node')].filter(g => g.dataset.state && g.dataset.state !== 'unknown').length;
  const charts = ['chart-samples', 'chart-actors', 'chart-loss'].map(id => Number(document.getElementById(id).dataset.points || 0));
  const boxes = Number(document.getElementById('timeline').dataset.boxes || 0);
  const ranks = document.querySelectorAll('#rank-table tbody tr').length;
  const registers = document.querySelectorAll('#register-table tbody tr').length;
  return JSON.stringify({rows, nodes, colored, charts, boxes, ranks, registers,
                         live: document.getElementById('live').textContent,
                         status: document.getElementById('status').textContent,
                         step: document.getElementById('s-step').textContent});
})())JS";

}  // namespace

TEST_CASE("Browser.DashboardShowsALiveTrainingRun" * doctest::timeout(300)) {
  const auto chromium = find_chromium();
  if (!chromium) {
    return baton::test::skip(baton::test::Missing::chromium,
                             "no chromium on PATH (Debian: apt-get install chromium; or set BATON_CHROMIUM)");
  }
  // A run long enough for the whole test; the test ends it. BATON_BROWSER_TRAIN_ARGS replaces
  // the model and its parallelism (e.g. "--model gpt --data text:README.md --pp 2 --microbatches 4").
  std::vector<std::string> args{std::string(BATON_BIN_DIR) + "/baton-train", "--steps", "10000000", "--dashboard",
                                "127.0.0.1:0"};
  std::vector<std::string> model{"--model", "mlp", "--data", "synthetic", "--batch", "64", "--pp", "2", "--microbatches", "4"};
  if (const char* given = std::getenv("BATON_BROWSER_TRAIN_ARGS"); given != nullptr && *given != '\0') {
    model.clear();
    std::istringstream words(given);
    for (std::string w; words >> w;) model.push_back(w);
  }
  args.insert(args.end(), model.begin(), model.end());
  Proc train(args);
  const std::regex url_re(R"(dashboard at (http://127\.0\.0\.1:(\d+)/))");
  std::smatch m;
  REQUIRE_MESSAGE(train.read_until([&](const std::string&, const std::string& err) { return std::regex_search(err, m, url_re); },
                                   60s),
                  "baton-train did not print its dashboard URL: " << train.all());
  const std::string url = m[1];
  const auto port = static_cast<std::uint16_t>(std::stoi(m[2]));

  // The plan's actors, as the server knows them.
  json::object plan;
  for (int i = 0; i < 100; ++i) {
    plan = json::parse(baton::test::http_get(port, "/api/plan").body).as_object();
    if (plan.at("complete").as_bool()) break;
    std::this_thread::sleep_for(100ms);
  }
  REQUIRE(plan.at("complete").as_bool());
  std::set<std::string> actors;
  for (const auto& a : plan.at("actors").as_array()) actors.insert(std::string(a.at("name").as_string()));
  REQUIRE(actors.size() > 20);

  TempDir profile;
  const fs::path log = profile.path / "chromium.log";
  const std::string command =
      "exec '" + *chromium +
      "' --headless=new --no-sandbox --disable-gpu --disable-dev-shm-usage --no-first-run "
      "--no-default-browser-check --disable-extensions --remote-debugging-port=0 --user-data-dir='" +
      (profile.path / "profile").string() + "' --window-size=1400,1000 about:blank >'" + log.string() + "' 2>&1";
  Proc browser({"sh", "-c", command});
  // Chromium writes its DevTools port into the profile once it listens.
  const fs::path port_file = profile.path / "profile" / "DevToolsActivePort";
  const auto started = std::chrono::steady_clock::now();
  while (!fs::exists(port_file) || read_file(port_file).find('\n') == std::string::npos) {
    if (!baton::test::process_alive(browser.pid()) || std::chrono::steady_clock::now() - started > 60s) {
      train.kill_group(SIGKILL);
      return baton::test::skip(baton::test::Missing::chromium,
                               "chromium (" + *chromium + ") did not start: " + tail(read_file(log)));
    }
    std::this_thread::sleep_for(100ms);
  }
  const auto devtools_port = static_cast<std::uint16_t>(std::stoi(read_file(port_file)));
  // The port file may come a moment before the socket listens: retry for a while.
  std::string listing;
  for (int attempt = 0; listing.empty(); ++attempt) {
    try {
      listing = baton::test::http_get(devtools_port, "/json/list").body;
    } catch (const std::exception& e) {
      if (attempt == 100) FAIL("chromium's DevTools port " << devtools_port << " does not answer: " << e.what());
      std::this_thread::sleep_for(100ms);
    }
  }
  std::string ws_url;
  const json::value targets = json::parse(listing);
  for (const auto& t : targets.as_array()) {
    if (t.at("type").as_string() == "page") {
      ws_url = std::string(t.at("webSocketDebuggerUrl").as_string());
      break;
    }
  }
  REQUIRE_MESSAGE(!ws_url.empty(), "chromium lists no page target");

  baton::test::DevTools dt(ws_url, 30s);
  dt.call("Runtime.enable");
  dt.call("Page.enable");
  dt.call("Page.navigate", {{"url", url}});

  // Poll the DOM until the page shows the live run, or give up after a while.
  json::object seen;
  bool ready = false;
  const auto deadline = std::chrono::steady_clock::now() + 120s;
  while (!ready && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(500ms);
    json::value v = dt.evaluate(probe_js);
    if (!v.is_string()) continue;
    seen = json::parse(v.as_string()).as_object();
    std::size_t moving = 0;
    for (const auto& r : seen.at("rows").as_array()) {
      if (actors.count(std::string(r.at(0).as_string())) && r.at(1).to_number<double>() > 0) ++moving;
    }
    bool charts = true;
    for (const auto& c : seen.at("charts").as_array()) charts = charts && c.to_number<double>() >= 2;
    ready = moving == actors.size() && seen.at("nodes").as_array().size() == actors.size() &&
            seen.at("colored").to_number<std::size_t>() == actors.size() && charts &&
            seen.at("boxes").to_number<double>() > 0 && seen.at("ranks").to_number<int>() == 1 &&
            seen.at("registers").to_number<int>() > 0 &&
            // And the badge: the first picture comes from /api/state, and the badge turns
            // "● live" at the first event of the /api/events stream, which on a loaded CI run
            // (beside the multi-process tests) came after a sample that had every figure.
            std::string(seen.at("live").as_string()).find("live") != std::string::npos;
  }
  INFO("the page showed: " << json::serialize(seen));
  CHECK(ready);
  CHECK(std::string(seen.at("live").as_string()).find("live") != std::string::npos);
  CHECK(seen.at("status").as_string() == "running");
  std::set<std::string> nodes;
  for (const auto& n : seen.at("nodes").as_array()) nodes.insert(std::string(n.as_string()));
  CHECK(nodes == actors);
  // The page threw nothing and logged no error.
  std::string problems;
  for (const auto& e : dt.events()) {
    const auto method = e.at("method").as_string();
    if (method == "Runtime.exceptionThrown" ||
        (method == "Runtime.consoleAPICalled" && e.at("params").at("type").as_string() == "error")) {
      if (problems.size() < 4000) problems += json::serialize(e) + "\n";
    }
  }
  CHECK_MESSAGE(problems.empty(), problems);

  // A screenshot of the whole page, as a test artifact.
  auto metrics = dt.call("Page.getLayoutMetrics");
  const double height = metrics.at("cssContentSize").at("height").to_number<double>();
  dt.call("Emulation.setDeviceMetricsOverride", {{"width", 1400},
                                                 {"height", static_cast<std::int64_t>(std::min(height, 6000.0))},
                                                 {"deviceScaleFactor", 1},
                                                 {"mobile", false}});
  std::this_thread::sleep_for(1500ms);  // a live update redraws the charts at the new size
  auto shot = dt.call("Page.captureScreenshot", {{"format", "png"}});
  const std::string png = baton::test::base64_decode(shot.at("data").as_string());
  CHECK(png.size() > 20'000);
  CHECK(png.substr(0, 8) == std::string("\x89PNG\r\n\x1a\n", 8));
  fs::create_directories(BATON_ARTIFACT_DIR);
  const fs::path out = fs::path(BATON_ARTIFACT_DIR) / "dashboard.png";
  std::ofstream(out, std::ios::binary) << png;
  // And the first screen alone, readable at a glance (the README's picture).
  auto top = dt.call("Page.captureScreenshot",
                     {{"format", "png"}, {"clip", {{"x", 0}, {"y", 0}, {"width", 1400}, {"height", 1400}, {"scale", 1}}}});
  std::ofstream(fs::path(BATON_ARTIFACT_DIR) / "dashboard-top.png", std::ios::binary)
      << baton::test::base64_decode(top.at("data").as_string());
  MESSAGE("screenshots: " << out.string() << ", dashboard-top.png");

  browser.kill_group(SIGTERM);
  browser.wait(10s);
  train.kill_group(SIGTERM);
  train.wait(10s);
}

int main(int argc, char** argv) { return baton::test::run_tests(argc, argv); }
