"""Deciding on a cell that waits for approval: whoever may change the Run's session may decide,
once. The worker running the Turn is waiting on Redis for it (fleet_worker.approvals), so any
gateway can take the decision, also one started after the cell began to wait."""

from __future__ import annotations

from litestar import Controller, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody

from fleet_gateway.errors import ApiError, not_found
from fleet_gateway.routes.runs import find_run
from fleet_gateway.schemas import ApprovalDecisionIn, ApprovalDecisionOut
from fleet_gateway.state import GatewayState
from fleet_shared.approvals import ApprovalDecision, decide
from fleet_shared.run_state import is_terminal
from fleet_shared.tenancy import Principal


class ApprovalController(Controller):
    path = "/api/runs/{run_id:str}/approvals/{approval_id:str}"

    @post("/", status_code=200)
    async def decide_approval(
        self,
        gw: NamedDependency[GatewayState],
        caller: NamedDependency[Principal],
        run_id: FromPath[str],
        approval_id: FromPath[str],
        data: JSONBody[ApprovalDecisionIn],
    ) -> ApprovalDecisionOut:
        """Approve the cell (it runs) or deny it (it does not; the RLM is told why, with the
        note). 404 for an approval the Run never asked for, or one long past; 409
        `approval_decided` once it was decided or timed out."""
        async with gw.db_sessions() as db:
            run = await find_run(db, run_id, caller, write=True)
        if run is None:
            raise not_found("run")
        if is_terminal(run.status):
            raise ApiError(409, "approval_decided", "the Run has ended: nothing waits for a decision")
        if not approval_id.isalnum() or len(approval_id) > 64:
            raise not_found("approval")
        decision = ApprovalDecision(data.decision, data.note, caller.user)
        recorded = await decide(gw.redis, run.id, approval_id, decision)
        if recorded == "unknown":
            raise not_found("approval")
        if recorded == "already_decided":
            raise ApiError(409, "approval_decided", "this cell was already decided, or its wait timed out")
        return ApprovalDecisionOut(run_id=run.id, approval_id=approval_id, decision=data.decision)
