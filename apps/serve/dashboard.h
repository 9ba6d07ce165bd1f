#pragma once
// baton-serve's live page (GET / on the server's port): batch size, queue, KV-cache use, the
// engine's utilisation and tokens/s over time, TTFT and TPOT percentiles, which weights answer.
// Self-contained (no scripts from elsewhere: clusters are often offline); it asks for the API key
// once (or takes it from the address's #key=...) and polls /api/serve every second.
#include <string_view>

namespace baton::serve {

std::string_view dashboard_html();

}  // namespace baton::serve
