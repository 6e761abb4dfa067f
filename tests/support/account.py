"""The suite's account: the emulator's API key and secret every test uses, and the
namespace of the unit tests' token store."""

from __future__ import annotations

from merchant_tasks.store.token_store import TokenStore

TEST_API_KEY = "test-app-id"
TEST_SECRET = "test-secret-4f1c9a7e2b"  # searched for in every leak test
UNIT_NAMESPACE = TokenStore.namespace_for("mt-test", "sandbox", "app-id-1234")
